"""Validates a raw request record and decides where it goes: a tier topic, or the DLQ."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Generic, TypeVar

from pydantic import ValidationError
from pydantic_core import from_json

from services.ingest.apps import App
from services.ingest.response_cache import cache_key
from shared.dead_letters import DeadLetter, ReplyStatus, Source, letter
from shared.kafka import encode
from shared.messages import (
    REQUEST_ID,
    CacheEntry,
    ErrorCode,
    ErrorResult,
    QueuedRequest,
    ReplyTo,
    RequestLimits,
    RequestRecord,
    Tier,
    error_message,
    over_budget,
)
from shared.topics import Topics

_REQUEST_ID = re.compile(REQUEST_ID)
K = TypeVar("K")

# Longest rejection message kept: it travels in a DLQ header and in the error result.
MAX_MESSAGE_CHARS = 1000
# What a dead letter keeps of a record refused unread: enough to tell what it was.
UNREAD_COPY_BYTES = 1024


class Reason(StrEnum):
    """Why a record was not admitted: the `tokenbus-reason` header of its DLQ copy."""

    not_json = "not_json"  # not JSON, not UTF-8, a lone surrogate, or nested too deep
    not_object = "not_object"
    invalid_field = "invalid_field"  # wrong type, size or value; unknown field
    over_budget = "over_budget"  # no batch of any tier could carry it
    too_large = "too_large"  # its tier record would be larger than a record may be
    reply_to_reserved = "reply_to_reserved"  # names a topic of tokenbus's own pipeline
    reply_to_missing = "reply_to_missing"
    reply_to_partition = "reply_to_partition"  # partition out of range
    reply_to_forbidden = "reply_to_forbidden"  # invalid name, internal, not authorised, or
    # (an application's record) not the application's own reply topic
    tenant_forbidden = "tenant_forbidden"  # an application's record claims another tenant
    plan_forbidden = "plan_forbidden"  # an application's record claims a key's plan
    variant_forbidden = "variant_forbidden"  # an application's record pins a variant
    created_at_forbidden = "created_at_forbidden"  # an application's record sets its own clock
    rate_limited = "rate_limited"  # an application over its quota (ingest_app_rps)
    not_forwarded = "not_forwarded"  # the tier topic refused it for good
    internal = "internal"  # ingest failed on it (a defect): dead-lettered, not retried


@dataclass(frozen=True)
class Admitted:
    request: QueuedRequest
    topic: str
    value: bytes  # the tier record, encoded once here: what the shell publishes
    # Set by the shell on a response-cache hit: the answer goes to `reply_to`, not the tier.
    answer: CacheEntry | None = None


@dataclass(frozen=True)
class Rejected:
    """A record that cannot be admitted: it goes to the DLQ, and its error to `reply_to`."""

    reason: Reason
    code: ErrorCode
    message: str
    request_id: str | None
    reply_to: ReplyTo | None
    retry_after_ms: int | None = None  # with `rate_limited`
    # Refused before it was parsed (an application over its quota): its dead letter keeps
    # only the first `UNREAD_COPY_BYTES` of it, so a flood's copies cost the DLQ little.
    unread: bool = False

    def error_result(self) -> ErrorResult | None:
        """The error the requester gets, when it named (or defaulted) a usable reply_to."""
        if self.request_id is None or self.reply_to is None:
            return None
        return ErrorResult.for_request(
            self.request_id, self.code, self.message, retry_after_ms=self.retry_after_ms
        )

    def dead_letter(
        self,
        value: bytes,
        key: bytes | None,
        source: Source,
        reply: ReplyStatus,
        reply_error: str | None,
        *,
        max_record_bytes: int,
        reader: str,
    ) -> DeadLetter:
        """Its DLQ record: the record as written, cut to fit `max_record_bytes` (to its
        first `UNREAD_COPY_BYTES` if it was refused unread)."""
        return letter(
            value,
            key=key,
            source=source,
            reason=self.reason.value,
            code=self.code.value,
            error=self.message,
            reader=reader,
            reply=reply,
            request_id=self.request_id,
            reply_error=reply_error,
            max_record_bytes=max_record_bytes,
            keep_bytes=UNREAD_COPY_BYTES if self.unread else None,
        )


@dataclass(frozen=True)
class Duplicate:
    request_id: str


Decision = Admitted | Rejected | Duplicate


class Recent(Generic[K]):
    """The last `size` keys remembered, oldest forgotten first."""

    def __init__(self, size: int = 100_000) -> None:
        self._keys: OrderedDict[K, None] = OrderedDict()
        self._size = size

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def remember(self, key: K) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self._size:
            self._keys.popitem(last=False)


class RecentIds(Recent[str]):
    """Request ids forwarded to a tier, to drop a request delivered twice.

    Caller: the ingest shell. It calls `remember` only once a tier holds the request, and
    refills this from the tier topics' tails on each partition assignment
    (`services.ingest.memory`), so the memory outlives the process.
    """


def admit(
    raw: bytes,
    key: bytes | None,
    topics: Topics,
    limits: RequestLimits,
    recent: Container[str],
    max_record_bytes: int = 1_000_000,
    cache: bool = False,
    app: App | None = None,
) -> Decision:
    """Parse and validate one `tokenbus.requests` record; never raises, whatever `raw` holds.

    `recent` holds the ids already handed on (a request seen again is a `Duplicate`);
    `max_record_bytes` bounds the tier record it would forward (the broker refuses larger).
    `cache`: the response cache is on; a cacheable request gets its `cache_key`.
    `app`: the outside application whose own topic the record was read from (None: the
    shared requests topic, written by the edge or a trusted local producer). Its tenant,
    reply topic and request-id scope are the application's, whatever the record claims.
    Whether `reply_to` exists is the shell's question (it needs the broker's metadata).
    """
    key_id = _request_id(key)
    if app is not None and key_id is not None:
        key_id = _request_id(app.scoped(key_id))
    try:
        # pydantic-core's parser: strict UTF-8, no lone surrogates, a bounded nesting depth.
        body = from_json(raw)
    except ValueError as exc:
        # Still answered where the record can be read well enough to say where (ADR 0044).
        request_id, reply_to = _addressee(_tolerant(raw), key_id, topics, app)
        message = f"record is not valid JSON in UTF-8: {exc}"
        return _rejected(Reason.not_json, message, request_id, reply_to)
    if not isinstance(body, dict):
        return _rejected(Reason.not_object, "record is not a JSON object", key_id, _own(app))
    if app is not None:
        claimed = _claims_of(body, app)
        if claimed is not None:
            request_id, reply_to = _addressee(body, key_id, topics, app)
            return Rejected(claimed[0], ErrorCode.unauthorized, claimed[1], request_id, reply_to)
        body = _as_written_by(body, app)
    if "request_id" not in body and key_id is not None:
        body["request_id"] = key_id
    request_id = _request_id(body.get("request_id")) or key_id
    try:
        record = RequestRecord.model_validate(body, context={"limits": limits})
    except ValidationError as exc:
        return _rejected(
            Reason.invalid_field, error_message(exc), request_id, _reply_to(body, topics, app)
        )
    reply_to = record.reply_to or ReplyTo(topic=topics.results)
    if reply_to.topic in reserved_topics(topics):
        message = f"reply_to.topic: {reply_to.topic} is a topic of tokenbus itself"
        return _rejected(Reason.reply_to_reserved, message, record.request_id, None)
    queued = QueuedRequest.from_record(
        record, tier=record.priority or Tier.interactive, reply_to=reply_to
    )
    too_big = over_budget(
        queued.prompt_tokens, queued.effective_max_tokens, limits.max_request_tokens
    )
    if too_big is not None:
        return _rejected(Reason.over_budget, too_big, record.request_id, reply_to)
    if queued.request_id in recent:
        return Duplicate(queued.request_id)
    if cache and queued.cacheable:
        queued = queued.model_copy(update={"cache_key": cache_key(queued)})
    value = encode(queued)
    if len(value) > max_record_bytes:
        message = f"request is {len(value)} bytes on its tier topic, above {max_record_bytes}"
        return _rejected(Reason.too_large, message, record.request_id, reply_to)
    return Admitted(queued, topics.tier(queued.tier), value)


def undeliverable(decision: Admitted | Rejected, reason: Reason, why: str) -> Rejected:
    """A decision whose `reply_to` turned out not to exist or not to be writable."""
    if isinstance(decision, Admitted):
        request_id: str | None = decision.request.request_id
    else:
        request_id = decision.request_id
    return Rejected(reason, ErrorCode.invalid_request, _bounded(why), request_id, None)


def not_forwarded(decision: Admitted, why: str) -> Rejected:
    """An admitted request its tier topic refused for good (not a transient failure)."""
    request = decision.request
    message = f"request could not be forwarded to {decision.topic}: {why}"
    return Rejected(
        Reason.not_forwarded,
        ErrorCode.internal,
        _bounded(message),
        request.request_id,
        request.reply_to,
    )


def without_reply(rejected: Rejected) -> Rejected:
    return replace(rejected, reply_to=None)


def over_quota(app: App, key: bytes | None, retry_after_ms: int) -> Rejected:
    """An application's record over its quota (records or bytes per second), refused before
    it is parsed (issue 37, N6): answered on the app's own reply topic under the request id
    its key carries (if it is one), with when to send it again."""
    key_id = _request_id(key)
    request_id = _request_id(app.scoped(key_id)) if key_id is not None else None
    message = f"app {app.name} is over its quota; retry after {retry_after_ms} ms"
    return Rejected(
        Reason.rate_limited,
        ErrorCode.rate_limited,
        message,
        request_id,
        _own(app),
        retry_after_ms,
        unread=True,
    )


def _claims_of(body: dict[str, object], app: App) -> tuple[Reason, str] | None:
    """Why an application's record claims what is not its own (tenant, plan, reply topic) or
    an operator's (a variant pin, its own clock), if so.

    Refused rather than overwritten: a claim of another identity is an attack or a
    misconfiguration, and either deserves a dead letter saying which.
    """
    tenant = body.get("tenant")
    if tenant is not None and tenant != app.tenant:
        return Reason.tenant_forbidden, f"tenant: app {app.name} may write as {app.tenant} only"
    if body.get("plan") is not None:
        # Plans belong to the edge's keys (ADR 0059): an application's requests have none.
        return Reason.plan_forbidden, f"plan: app {app.name} has no plan; plans are API keys'"
    if body.get("variant") is not None:
        # A pin is an operator's (a key with the pin_variant scope, an eval): one to a variant
        # no worker declares is held, and would hold its tier partition's commit for every
        # tenant (issue 37, N3); a pinned request also counts in a canary's window (N7).
        return (
            Reason.variant_forbidden,
            f"variant: app {app.name} may not pin a variant; the rollout chooses",
        )
    if body.get("created_at") is not None:
        # Ingest stamps the time: deadlines and the TTFT a canary is judged by count from it
        # (issue 37, N3 and N7).
        return (
            Reason.created_at_forbidden,
            f"created_at: app {app.name} may not set it; ingest stamps the time it was read",
        )
    raw = body.get("reply_to")
    if raw is not None:
        try:
            reply_to = ReplyTo.model_validate(raw)
        except ValidationError:
            return None  # refused as an invalid field, the error to its own reply topic
        if reply_to.topic != app.replies:
            return (
                Reason.reply_to_forbidden,
                f"reply_to.topic: app {app.name} receives results on {app.replies} only",
            )
    return None


def _as_written_by(body: dict[str, object], app: App) -> dict[str, object]:
    """The record with the application's identity: its tenant, its reply topic by default,
    and its request id in its own scope (App.scoped)."""
    owned = {**body, "tenant": app.tenant}
    if owned.get("reply_to") is None:
        owned["reply_to"] = {"topic": app.replies}
    request_id = body.get("request_id")
    if isinstance(request_id, str):
        owned["request_id"] = app.scoped(request_id)
    return owned


def _tolerant(raw: bytes) -> object:
    """A second, lenient reading of a record the strict parser refused: the stdlib's JSON
    takes escaped lone surrogates, so a record that has only those still names its
    addressee. Only `request_id` and `reply_to` are read from it; None if unreadable."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not UTF-8 / not JSON at all / nested too deep
        return None


def _addressee(
    body: object, key_id: str | None, topics: Topics, app: App | None
) -> tuple[str | None, ReplyTo | None]:
    """Who to tell about a refused record, and where, from what of it could be read."""
    if not isinstance(body, dict):
        return key_id, _own(app)
    raw_id = body.get("request_id")
    if app is not None and isinstance(raw_id, str):
        raw_id = app.scoped(raw_id)
    request_id = _request_id(raw_id) or key_id
    return request_id, _reply_to(body, topics, app)


def reserved_topics(topics: Topics) -> frozenset[str]:
    """Topics a result may never be written to: each is read by a tokenbus service."""
    return frozenset(
        {
            topics.requests,
            topics.dlq,
            *topics.tiers,
            topics.batches,
            topics.result_leases,
            topics.workers,
            topics.control,
            topics.cache,  # a result written there would be served as another's answer
        }
    )


def _rejected(
    reason: Reason, message: str, request_id: str | None, reply_to: ReplyTo | None = None
) -> Rejected:
    return Rejected(reason, ErrorCode.invalid_request, _bounded(message), request_id, reply_to)


def _bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 1] + "…"


def _own(app: App | None) -> ReplyTo | None:
    """An application's own reply topic: where each of its refused records is answered."""
    return ReplyTo(topic=app.replies) if app is not None else None


def _reply_to(body: dict[str, object], topics: Topics, app: App | None = None) -> ReplyTo | None:
    """Best effort: where to tell the requester about its bad request."""
    if app is not None:
        return _own(app)
    raw = body.get("reply_to")
    if raw is None:
        return ReplyTo(topic=topics.results)
    try:
        reply_to = ReplyTo.model_validate(raw)
    except ValidationError:
        return None
    return None if reply_to.topic in reserved_topics(topics) else reply_to


def _request_id(value: object) -> str | None:
    """A request id usable in an error result (the protocol's pattern), else None."""
    if isinstance(value, bytes):
        try:
            value = value.decode()
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str):
        return None
    return value if _REQUEST_ID.fullmatch(value) else None
