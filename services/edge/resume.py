"""Resume tokens: HMAC-signed claims that let a client continue a stream on any edge."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

from pydantic import Field, ValidationError

from shared.messages import Model


class ResumeClaims(Model):
    tenant: str
    request_id: str
    topic: str
    partition: int | None = Field(default=None, ge=0)
    offset: int = Field(ge=0, description="Result partition offset at or before the first record.")
    expires_at: float


class ResumeTokenError(Exception):
    """The token is malformed, tampered with or expired."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(claims: ResumeClaims, secret: bytes) -> str:
    body = _b64(claims.model_dump_json().encode())
    mac = hmac.new(secret, body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(mac)}"


def verify(token: str, secret: bytes, now: float | None = None) -> ResumeClaims:
    try:
        body, mac = token.split(".")
        expected = hmac.new(secret, body.encode(), hashlib.sha256).digest()
        if not hmac.compare_digest(expected, _unb64(mac)):
            raise ResumeTokenError("resume_token: signature does not match")
        claims = ResumeClaims.model_validate(json.loads(_unb64(body)))
    except (ValueError, ValidationError) as exc:
        raise ResumeTokenError("resume_token: malformed") from exc
    if claims.expires_at <= (time.time() if now is None else now):
        raise ResumeTokenError("resume_token: expired")
    return claims
