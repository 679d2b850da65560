"""Resume tokens: HMAC-signed claims that let a client continue a stream on any edge."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re

from pydantic import Field, SecretStr, ValidationError

from shared.messages import ErrorCode, Model
from shared.records import read

MIN_SECRET_BYTES = 32
# A random secret of 32 bytes has far more; this catches `aaaa...` and `abababab...`.
MIN_DISTINCT_CHARACTERS = 8
# Placeholders found in examples and old configs, refused at any length.
WEAK_SECRETS = frozenset(
    {
        "change-me",
        "changeme",
        "change_me",
        "change-me-please",
        "secret",
        "test-secret",
        "test",
        "password",
        "default",
        "tokenbus",
        "resume-secret",
        "edge-secret",
    }
)
KID = re.compile(r"[A-Za-z0-9_-]{1,32}")
SINGLE_KID = "0"  # the key id of TOKENBUS_RESUME_SECRET


class ResumeClaims(Model):
    tenant: str
    request_id: str
    topic: str
    partition: int | None = Field(default=None, ge=0)
    offset: int = Field(ge=0, description="Result partition offset at or before the first record.")
    expires_at: float


class ResumeKeys(Model):
    """The keys resume tokens are signed with: `signing_kid` signs, every key verifies.

    Values are `SecretStr`: a repr, a log line or a dump shows `**********`, never a key.
    """

    signing_kid: str
    keys: dict[str, SecretStr]

    @classmethod
    def from_settings(cls, single: SecretStr | None, listed: SecretStr | None) -> ResumeKeys:
        """The configured keys, or ValueError saying (without any secret) what is wrong.

        `listed` (TOKENBUS_RESUME_SECRETS, `kid:secret,kid:secret`, the first one signs)
        wins over `single` (TOKENBUS_RESUME_SECRET, key id `SINGLE_KID`).
        """
        if listed is not None and listed.get_secret_value().strip():
            pairs: list[tuple[str, str]] = []
            for n, entry in enumerate(listed.get_secret_value().split(","), start=1):
                kid, colon, secret = entry.strip().partition(":")
                if not colon or not KID.fullmatch(kid):
                    raise ValueError(
                        f"TOKENBUS_RESUME_SECRETS entry {n} is not `kid:secret` with a key id"
                        " of 1-32 letters, digits, `-` or `_`"
                    )
                _check_strength(secret, f"TOKENBUS_RESUME_SECRETS key {kid!r}")
                pairs.append((kid, secret))
            if len({kid for kid, _ in pairs}) != len(pairs):
                raise ValueError("TOKENBUS_RESUME_SECRETS names a key id twice")
            return cls(signing_kid=pairs[0][0], keys={k: SecretStr(v) for k, v in pairs})
        if single is None:
            raise ValueError(
                "TOKENBUS_RESUME_SECRET is unset: set it (or TOKENBUS_RESUME_SECRETS) to a random"
                f" secret of at least {MIN_SECRET_BYTES} bytes, the same on every edge, e.g."
                " `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
                " (`tokenbus up` generates one)"
            )
        _check_strength(single.get_secret_value(), "TOKENBUS_RESUME_SECRET")
        return cls(signing_kid=SINGLE_KID, keys={SINGLE_KID: single})


def _check_strength(secret: str, name: str) -> None:
    size = len(secret.encode())
    if secret.strip().lower() in WEAK_SECRETS:
        raise ValueError(f"{name} is a well-known placeholder; set a random secret")
    if size < MIN_SECRET_BYTES:
        raise ValueError(f"{name} is {size} bytes; it must be at least {MIN_SECRET_BYTES}")
    if len(set(secret)) < MIN_DISTINCT_CHARACTERS:
        raise ValueError(f"{name} repeats too few characters to be a random secret")


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


def _mac(key: SecretStr, signed: str) -> bytes:
    return hmac.new(key.get_secret_value().encode(), signed.encode(), hashlib.sha256).digest()


def sign(claims: ResumeClaims, keys: ResumeKeys) -> str:
    """`kid.body.mac`: the key id is signed with the body, so changing it breaks the mac."""
    signed = f"{keys.signing_kid}.{_b64(claims.model_dump_json().encode())}"
    return f"{signed}.{_b64(_mac(keys.keys[keys.signing_kid], signed))}"


def token_kid(token: str) -> str:
    """The key id a token names (unchecked: `verify` decides whether to trust it)."""
    return token.partition(".")[0]


def verify(token: str, keys: ResumeKeys, now: float) -> ResumeClaims:
    """The token's claims if it is intact and unexpired; otherwise ResumeRefused.

    Tampered, malformed or signed with a key no longer configured: `unauthorized` (nothing
    in it can be trusted). Expired: `not_found` (it was genuine, the stream is simply no
    longer offered).
    """
    signed, dot, mac = token.rpartition(".")
    kid, dot2, body = signed.partition(".")
    try:
        if not dot or not dot2 or "." in body:
            raise ValueError("not kid.body.mac")
        given = _unb64(mac)
    except (ValueError, binascii.Error):
        raise ResumeRefused(ErrorCode.unauthorized, "resume_token: malformed") from None
    key = keys.keys.get(kid)
    if key is None:
        raise ResumeRefused(ErrorCode.unauthorized, "resume_token: signed with an unknown key")
    if not hmac.compare_digest(_mac(key, signed), given):
        raise ResumeRefused(ErrorCode.unauthorized, "resume_token: signature does not match")
    try:
        claims = read(ResumeClaims, _unb64(body))
    except (ValueError, binascii.Error, ValidationError):
        # Signed by us but unreadable: only a change of claim format gets here.
        raise ResumeRefused(ErrorCode.unauthorized, "resume_token: malformed") from None
    if claims.expires_at <= now:
        raise ResumeRefused(ErrorCode.not_found, "stream.resume: the resume token has expired")
    return claims


def check_resume(
    token: str, keys: ResumeKeys, *, tenant: str, results_topic: str, now: float
) -> ResumeClaims:
    """Every check a resume passes before any record is read, as one pure function.

    `results_topic` is the deployment's results topic: a token may only point at it or at a
    per-request topic under it, so a leaked secret of another deployment reads nothing here.
    """
    claims = verify(token, keys, now)
    if not hmac.compare_digest(claims.tenant.encode(), tenant.encode()):
        raise ResumeRefused(
            ErrorCode.unauthorized, "stream.resume: the stream belongs to another tenant"
        )
    if claims.topic != results_topic and not claims.topic.startswith(results_topic + "."):
        raise ResumeRefused(ErrorCode.not_found, "stream.resume: no such stream here")
    return claims
