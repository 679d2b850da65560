"""Resume tokens: HMAC-signed claims that let a client continue a stream on any edge."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json

from pydantic import Field, ValidationError

from shared.messages import ErrorCode, Model


class ResumeClaims(Model):
    tenant: str
    request_id: str
    topic: str
    partition: int | None = Field(default=None, ge=0)
    offset: int = Field(ge=0, description="Result partition offset at or before the first record.")
    expires_at: float


class ResumeRefused(Exception):
    """A resume the edge will not serve; `code` is what the client is told."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(claims: ResumeClaims, secret: bytes) -> str:
    body = _b64(claims.model_dump_json().encode())
    mac = hmac.new(secret, body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(mac)}"


def verify(token: str, secret: bytes, now: float) -> ResumeClaims:
    """The token's claims if it is intact and unexpired; otherwise ResumeRefused.

    Tampered or malformed: `unauthorized` (nothing in it can be trusted). Expired:
    `not_found` (it was genuine, the stream is simply no longer offered).
    """
    body, dot, mac = token.partition(".")
    try:
        if not dot or "." in mac:
            raise ValueError("not body.mac")
        given = _unb64(mac)
    except (ValueError, binascii.Error):
        raise ResumeRefused(ErrorCode.unauthorized, "resume_token: malformed") from None
    expected = hmac.new(secret, body.encode(), hashlib.sha256).digest()
    if not hmac.compare_digest(expected, given):
        raise ResumeRefused(ErrorCode.unauthorized, "resume_token: signature does not match")
    try:
        claims = ResumeClaims.model_validate(json.loads(_unb64(body)))
    except (ValueError, binascii.Error, ValidationError):
        # Signed by us but unreadable: only a change of claim format gets here.
        raise ResumeRefused(ErrorCode.unauthorized, "resume_token: malformed") from None
    if claims.expires_at <= now:
        raise ResumeRefused(ErrorCode.not_found, "stream.resume: the resume token has expired")
    return claims


def check_resume(
    token: str, secret: bytes, *, tenant: str, results_topic: str, now: float
) -> ResumeClaims:
    """Every check a resume passes before any record is read, as one pure function.

    `results_topic` is the deployment's results topic: a token may only point at it or at a
    per-request topic under it, so a leaked secret of another deployment reads nothing here.
    """
    claims = verify(token, secret, now)
    if not hmac.compare_digest(claims.tenant.encode(), tenant.encode()):
        raise ResumeRefused(
            ErrorCode.unauthorized, "stream.resume: the stream belongs to another tenant"
        )
    if claims.topic != results_topic and not claims.topic.startswith(results_topic + "."):
        raise ResumeRefused(ErrorCode.not_found, "stream.resume: no such stream here")
    return claims
