"""Who may use a socket: the Origin check, the API key, the tenant id written to Kafka, quotas.

`Guard` holds the decisions of one edge process, `SocketAuth` one socket's state; a
`ChatSocket` (app.py) asks them at the upgrade, for each frame before its key, at the start
of each request, and when it closes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import structlog

from services.edge.keys import PIN_VARIANT, KeyStore, Principal
from services.edge.protocol import (
    AuthFrame,
    ChatRequestFrame,
    ClientFrame,
    ErrorFrame,
    ProtocolError,
)
from services.edge.quotas import Quotas, Refusal
from services.edge.resume import ResumeKeys
from services.edge.settings import EdgeSettings
from shared.messages import ChatRequest, ErrorCode, Usage

log = structlog.get_logger()

# RFC 6455 close codes
POLICY_VIOLATION = 1008
# How often open sockets are checked against the keys file: a revoked key's socket closes
# within this (`Guard.watch_revocations`).
REVOCATION_CHECK_S = 0.5
TRY_AGAIN_LATER = 1013
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
ANY_ORIGIN = "*"


@dataclass(frozen=True)
class Close:
    """Close the socket with this code and reason (RFC 6455 allows 123 bytes of reason)."""

    code: int
    reason: str


@dataclass(frozen=True)
class Refused:
    """An upgrade answered with an HTTP status instead of a socket; `reason` is logged."""

    status: int
    reason: str
    text: str


@dataclass(frozen=True)
class Upgrade:
    """The decision on a WebSocket upgrade: refused, or accepted with a principal (a key in
    the `Authorization` header) or without one (an `auth` frame must follow; `pending`)."""

    refused: Refused | None = None
    principal: Principal | None = None


# -- pure checks -------------------------------------------------------------------------------


def own_origins(host: str, port: int) -> frozenset[str]:
    """The origins of the edge's own chat page, for `host:port` it is bound to.

    Loopback: every loopback spelling, since the browser shows whichever the user typed.
    A wildcard bind (0.0.0.0, ::): the loopback names and this machine's host names; a
    public name or a proxy in front is configured (`TOKENBUS_EDGE_ALLOWED_ORIGINS`).
    """
    names: set[str] = set()
    bare = host.strip("[]")
    if bare in ("0.0.0.0", "::", ""):
        names.update(LOOPBACK_NAMES)
        names.update({socket.gethostname(), socket.getfqdn()})
    elif _is_loopback(bare):
        names.update(LOOPBACK_NAMES)
    else:
        names.add(f"[{bare}]" if ":" in bare else bare)
    return frozenset(f"{scheme}://{name}:{port}" for name in names for scheme in ("http", "https"))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str | None, allowed: frozenset[str]) -> bool:
    """No Origin: not a browser, so no page can be riding on the user's network position."""
    if origin is None:
        return True
    if ANY_ORIGIN in allowed:
        return True
    return _normalise_origin(origin) in allowed


def _normalise_origin(origin: str) -> str:
    parts = urlsplit(origin.strip().lower())
    default = {"http": 80, "https": 443}.get(parts.scheme)
    try:
        port = parts.port or default
    except ValueError:
        return ""
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}:{port}"


def allowed_origins(configured: Sequence[str] | None, host: str, port: int) -> frozenset[str]:
    if configured is None:
        return own_origins(host, port)
    return frozenset(o if o == ANY_ORIGIN else _normalise_origin(o) for o in configured)


class AmbiguousCredentials(ValueError):
    """More than one credential on one upgrade: which tenant is meant cannot be told."""


def key_from_headers(authorization: list[str], *, browser: bool) -> str | None:
    """The API key of an upgrade request, or None if it has none.

    `Bearer <key>`; or `Basic` with the key as password (`ws://tenant:KEY@host/v1/chat`,
    for clients that keep credentials in the URL), but never from a browser (`Origin` sent):
    a browser may replay Basic credentials it cached, and a key must never be ambient.
    """
    if len(authorization) > 1:
        raise AmbiguousCredentials("more than one Authorization header")
    if not authorization:
        return None
    scheme, _, value = authorization[0].strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and value:
        return value
    if scheme.lower() == "basic" and value and not browser:
        try:
            user, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise AmbiguousCredentials("Basic credentials that do not decode") from None
        return password or user or None
    raise AmbiguousCredentials(f"unsupported Authorization scheme {scheme[:16]!r}")


def tenant_id(secret: bytes, tenant: str) -> str:
    """The tenant as Kafka and resume tokens see it: a keyed hash of its name.

    Keyed (HMAC), so a reader of the topics cannot confirm a guess of a tenant's name; the
    same on every edge sharing the secret, so resume works across edges.
    """
    mac = hmac.new(secret, b"tokenbus-tenant-id\x00" + tenant.encode(), hashlib.sha256)
    return "t-" + mac.hexdigest()[:32]


def request_tokens(request: ChatRequest) -> int:
    """What a request is charged against tokens-per-minute when it is admitted: the prompt's
    token bound (never below its real count, shared/tokens.py) + max_tokens (unset: the
    output estimate, TOKENBUS_DEFAULT_MAX_TOKENS). Settled with the real `usage` when it
    ends (`Quotas.settle`), both ways: an answer longer than the estimate pays the rest."""
    return request.prompt_token_bound() + request.effective_max_tokens


def quota_refused(refusal: Refusal, client_id: str | None = None) -> ErrorFrame:
    """The client's answer to a refusal: `rate_limited` with when to retry, or, when no
    retry can help (`never`), `invalid_request`, as a request no model could run is."""
    if refusal.never:
        return ErrorFrame(
            code=ErrorCode.invalid_request,
            message=f"invalid_request ({refusal.limit}): {refusal.message}",
            client_id=client_id,
        )
    return ErrorFrame(
        code=ErrorCode.rate_limited,
        message=f"rate_limited ({refusal.limit}): {refusal.message}",
        client_id=client_id,
        retry_after_ms=refusal.retry_after_ms,
    )


def unauthorized(message: str, client_id: str | None = None) -> ErrorFrame:
    return ErrorFrame(code=ErrorCode.unauthorized, message=message, client_id=client_id)


def not_permitted(principal: Principal, request: ChatRequest) -> ErrorFrame | None:
    """A request that does what its key may not: name its variant without the key's
    `pin_variant` scope (services/scheduler/pinned.py)."""
    if request.variant is None or PIN_VARIANT in principal.scopes:
        return None
    return ErrorFrame(
        code=ErrorCode.invalid_request,
        message=f"variant: this API key may not pin a variant (it lacks the {PIN_VARIANT}"
        f" scope: `tokenbus keys create --scope {PIN_VARIANT}`)",
        client_id=request.client_id,
    )


# -- the guard: one per edge process -------------------------------------------------------------


class Guard:
    """The edge's keys, origins and quotas, and the decisions taken from them.

    Caller: `Edge` and its `ChatSocket`s, on one event loop.
    Affects: the quota counters (`quotas`); the keys file is only read.
    """

    def __init__(self, settings: EdgeSettings, resume_keys: ResumeKeys) -> None:
        self.keys = KeyStore(settings.edge_keys_file)
        self.quotas = Quotas()
        self.origins = allowed_origins(
            settings.edge_allowed_origins, settings.edge_host, settings.edge_port
        )
        self.auth_timeout_s = settings.edge_auth_timeout_s
        self.max_unauthenticated_frames = settings.edge_max_unauthenticated_frames
        self.max_pending = settings.edge_max_unauthenticated_sockets
        self.pending = 0  # sockets open without a key yet (`auth` frame awaited)
        self._resume_keys = resume_keys
        # Sockets open with a key -> how to close one whose key is revoked.
        self._open: dict[KeyHolder | SocketAuth, Callable[[], None]] = {}
        if not len(self.keys):
            log.warning(
                "keys.none",
                path=str(settings.edge_keys_file),
                hint="every key is refused: `tokenbus keys create --tenant NAME` adds one",
            )

    def upgrade(self, origin: str | None, authorization: list[str]) -> Upgrade:
        """Decide an upgrade from its headers. A socket accepted without a key holds one of
        the `pending` places until its `SocketAuth` gives it back."""
        if not origin_allowed(origin, self.origins):
            return Upgrade(Refused(403, "origin", "Origin not allowed"))
        try:
            key = key_from_headers(authorization, browser=origin is not None)
        except AmbiguousCredentials as exc:
            return Upgrade(Refused(403, "credentials", f"unusable credentials: {exc}"))
        if key is not None:
            principal = self.keys.lookup(key)
            if principal is None:
                return Upgrade(Refused(403, "unknown_key", "unknown or revoked API key"))
            return Upgrade(principal=principal)
        if self.pending >= self.max_pending:
            # A flood of sockets that never authenticate: each holds a place for at most
            # the auth timeout, and there are only so many places.
            return Upgrade(Refused(503, "pending_sockets", "too many sockets without a key"))
        self.pending += 1
        return Upgrade()

    def left_pending(self) -> None:
        self.pending -= 1

    def tenant_id(self, tenant: str, kid: str | None = None) -> str:
        """The id of `tenant` (its name) under resume key `kid` (default: the signing key).

        Rotating the signing key changes the ids new requests carry; a resume token names
        the key it was signed with, so its tenant is checked under that key (`kid`).
        """
        keys = self._resume_keys
        key = keys.keys.get(kid or keys.signing_kid) or keys.keys[keys.signing_kid]
        return tenant_id(key.get_secret_value().encode(), tenant)

    def open_socket(self, principal: Principal) -> Close | None:
        refusal = self.quotas.open_socket(principal.tenant, principal.limits)
        if refusal is None:
            return None
        log.info("quota.refused", limit=refusal.limit, key_id=principal.key_id)
        return Close(TRY_AGAIN_LATER, f"rate_limited: {refusal.message}"[:123])

    def close_socket(self, principal: Principal) -> None:
        self.quotas.close_socket(principal.tenant)

    def admit(self, principal: Principal, frame: ChatRequest, request_id: str) -> ErrorFrame | None:
        """Decide one request before anything of it reaches Kafka: the key is still valid,
        may do what the request asks (`not_permitted`), and the tenant's quotas (as the keys
        file says now) have room."""
        current = self.keys.current(principal)
        if current is None:
            log.info("auth.revoked_key_used", key_id=principal.key_id)
            return unauthorized("the socket's API key was revoked", frame.client_id)
        if refused := not_permitted(current, frame):
            log.info("auth.not_permitted", key_id=principal.key_id, field="variant")
            return refused
        refusal = self.quotas.admit(
            current.tenant, current.limits, request_id, request_tokens(frame), frame.guided
        )
        if refusal is None:
            return None
        log.info("quota.refused", limit=refusal.limit, key_id=principal.key_id)
        return quota_refused(refusal, frame.client_id)

    def charge(self, principal: Principal, what: str) -> ErrorFrame | None:
        """Decide a frame that opens no stream (`what`: stream.resume, chat.cancel): the key
        is still valid, and the tenant's request rate has room (each is charged as one)."""
        current = self.keys.current(principal)
        if current is None:
            log.info("auth.revoked_key_used", key_id=principal.key_id, frame=what)
            return unauthorized(f"{what}: the socket's API key was revoked")
        refusal = self.quotas.charge(current.tenant, current.limits)
        if refusal is None:
            return None
        log.info("quota.refused", limit=refusal.limit, key_id=principal.key_id, frame=what)
        return quota_refused(refusal)

    def hold(self, principal: Principal, request_id: str) -> ErrorFrame | None:
        """A concurrency slot for a stream resumed on this edge, until `release`."""
        current = self.keys.current(principal)
        if current is None:
            return unauthorized("stream.resume: the socket's API key was revoked")
        refusal = self.quotas.hold(current.tenant, current.limits, request_id)
        if refusal is None:
            return None
        log.info("quota.refused", limit=refusal.limit, key_id=principal.key_id)
        return quota_refused(refusal)

    def start_replay(self, principal: Principal, partition: str) -> ErrorFrame | None:
        """One of the tenant's replay places for a resume's read of `partition`, until
        `end_replay`. Refused as `overloaded` with a retry hint: the clients resume again
        then (the SDK and the chat page do), as when the edge's replay readers are busy."""
        current = self.keys.current(principal)
        if current is None:
            return unauthorized("stream.resume: the socket's API key was revoked")
        refusal = self.quotas.start_replay(current.tenant, current.limits, partition)
        if refusal is None:
            return None
        log.info("quota.refused", limit=refusal.limit, key_id=principal.key_id)
        return ErrorFrame(
            code=ErrorCode.overloaded,
            message=f"stream.resume: {refusal.message}; resume again later",
            retry_after_ms=refusal.retry_after_ms,
        )

    def end_replay(self, principal: Principal, partition: str, scanned: int) -> None:
        """The replay read `scanned` records: its place is given back, the read charged."""
        self.quotas.end_replay(principal.tenant, partition, scanned)

    def settle(self, request_id: str, usage: Usage) -> None:
        """A request ended with its real usage: its tokens charge is corrected to it."""
        self.quotas.settle(request_id, usage.prompt_tokens + usage.completion_tokens)

    def release(self, request_id: str) -> None:
        self.quotas.release(request_id)

    def watch(self, auth: KeyHolder | SocketAuth, on_revoked: Callable[[], None]) -> None:
        """Call `on_revoked` once `auth.principal`'s key is revoked (a socket, an HTTP answer)."""
        self._open[auth] = on_revoked

    def unwatch(self, auth: KeyHolder | SocketAuth) -> None:
        self._open.pop(auth, None)

    def revoked(self) -> list[Callable[[], None]]:
        """The close callbacks of open sockets whose key the keys file no longer has."""
        gone = [
            (auth, principal, close)
            for auth, close in self._open.items()
            if (principal := auth.principal) is not None and self.keys.current(principal) is None
        ]
        for auth, principal, _ in gone:
            del self._open[auth]
            log.info("auth.revoked_socket_closed", key_id=principal.key_id)
        return [close for _, _, close in gone]

    async def watch_revocations(self) -> None:
        """Close the sockets of revoked keys within `REVOCATION_CHECK_S` (one `stat` a turn:
        the keys file is read again only when it changed)."""
        while True:
            await asyncio.sleep(REVOCATION_CHECK_S)
            for close in self.revoked():
                close()


class KeyHolder:
    """An HTTP answer in progress, watched for its key's revocation as a socket is."""

    def __init__(self, principal: Principal) -> None:
        self.principal: Principal | None = principal


class SocketAuth:
    """One socket's authentication: who it speaks for, and until when it may go without.

    Caller: its `ChatSocket`, from the socket's reader task.
    Affects: the guard's `pending` places and the tenant's open-socket count; `end()` gives
    back whatever the socket holds.
    """

    def __init__(
        self,
        guard: Guard,
        upgrade: Upgrade,
        now: float,
        on_revoked: Callable[[], None] = lambda: None,
    ) -> None:
        self._guard = guard
        self._on_revoked = on_revoked  # the socket's key was revoked: close it
        self._presented = upgrade.principal  # a key in the upgrade's Authorization header
        self._pending = upgrade.principal is None  # holds a `pending` place (Guard.upgrade)
        self._frames = 0  # frames answered `unauthorized`
        self.deadline = now + guard.auth_timeout_s
        self.principal: Principal | None = None
        self.tenant = ""  # keyed hash of the tenant's name: what Kafka and resume tokens see

    @property
    def authenticated(self) -> bool:
        return self.principal is not None

    @property
    def presented(self) -> bool:
        """A key came in the upgrade's Authorization header (checked by `start`)."""
        return self._presented is not None

    @property
    def widened_as(self) -> str:
        """The tenant whose share of the listener's message budget the socket draws on (the
        key's, from the upgrade or the `auth` frame; ws_protocol.py)."""
        principal = self.principal or self._presented
        return principal.tenant if principal is not None else ""

    def start(self) -> Close | None:
        """A key from the upgrade's headers takes its socket place now (or the socket closes)."""
        return self._take_socket(self._presented) if self._presented is not None else None

    def before_key(
        self, frame: ClientFrame | ProtocolError
    ) -> tuple[ErrorFrame | None, Close | None]:
        """A frame on a socket without a key: a valid `auth` admits it, the rest is refused;
        too many refusals close the socket."""
        if isinstance(frame, AuthFrame):
            principal = self._guard.keys.lookup(frame.api_key)
            if principal is not None:
                return None, self._take_socket(principal)
            log.info("auth.refused", reason="unknown_key", via="frame")
            message = "auth: unknown or revoked API key"
        else:
            message = "send a valid API key first (`auth` frame or Authorization: Bearer)"
        client_id = frame.client_id if isinstance(frame, ChatRequestFrame | ProtocolError) else None
        self._frames += 1
        close = None
        if self._frames >= self._guard.max_unauthenticated_frames:
            close = Close(POLICY_VIOLATION, "too many frames without a valid API key")
        return unauthorized(message, client_id), close

    def timed_out(self) -> Close:
        log.info("auth.timed_out", frames=self._frames)
        return Close(POLICY_VIOLATION, "no valid API key within the auth timeout")

    def again(self, frame: AuthFrame) -> ErrorFrame | None:
        """`auth` on an authenticated socket: the same tenant is a no-op; no switching."""
        assert self.principal is not None
        other = self._guard.keys.lookup(frame.api_key)
        if other is None:
            return unauthorized("auth: unknown or revoked API key")
        if other.tenant != self.principal.tenant:
            return unauthorized("auth: this socket is authenticated as another tenant")
        return None

    def charge(self, what: str) -> ErrorFrame | None:
        """A resume or cancel from this socket, charged to its tenant (`Guard.charge`)."""
        assert self.principal is not None  # the socket reads no such frame before its key
        return self._guard.charge(self.principal, what)

    def end(self) -> None:
        """The socket closed: give back its socket place or its pending place."""
        if self.principal is not None:
            self._guard.unwatch(self)
            self._guard.close_socket(self.principal)
            self.principal = None
        if self._pending:
            self._guard.left_pending()
            self._pending = False

    def _take_socket(self, principal: Principal) -> Close | None:
        if refused := self._guard.open_socket(principal):
            return refused
        if self._pending:
            self._guard.left_pending()
            self._pending = False
        self.principal = principal
        self.tenant = self._guard.tenant_id(principal.tenant)
        self._guard.watch(self, self._on_revoked)
        return None
