"""The worker's part of the response cache: a complete deterministic answer, stored.

Ingest marks a cacheable request that missed the cache with its `cache_key`; the worker
that answers it completely (`finish_reason` stop or length, every record stored) writes
the answer under that key to the compacted cache topic, through the result outbox. Errors,
cancels and hand-backs are never stored. A failed write costs only a later cache miss,
so it is logged, not retried. See docs/decisions/0036-response-cache.md.
"""

from __future__ import annotations

import structlog

from services.worker.outbox import ResultOutbox
from shared.kafka import encode, key_of
from shared.messages import CacheEntry, DoneResult, QueuedRequest, ReplyTo

log = structlog.get_logger()


class CacheWriter:
    """Caller: the runner, once a run's final record is stored. Owns nothing."""

    def __init__(self, outbox: ResultOutbox, topic: str, model: str) -> None:
        self._outbox = outbox
        self._to = ReplyTo(topic=topic)  # keyed: the producer places each key's partition
        self._model = model

    def store(self, request: QueuedRequest, chunks: list[str], final: DoneResult) -> bool:
        """Queue the answer for the cache topic; False when this answer is not for it."""
        key = request.cache_key
        if key is None or final.finish_reason not in ("stop", "length"):
            return False  # a repetition cut short is no answer to replay
        # A request that names another model ran here as its fallback: not its answer.
        named = request.model
        if named is not None and named != self._model:
            return False
        entry = CacheEntry(
            key=key,
            chunks=chunks,
            finish_reason="stop" if final.finish_reason == "stop" else "length",
            usage=final.usage,
            model=self._model,
            request_id=request.request_id,
        )
        self._outbox.put(self._to, key_of(key), encode(entry), None, _Logged(request.request_id))
        return True


class _Logged:
    """The outbox's ticket for a cache write: nobody waits for it; a failure is logged."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id

    def stored(self) -> None:
        log.debug("cache.stored", request_id=self._request_id)

    def failed(self, error: BaseException) -> None:
        log.warning("cache.store_failed", request_id=self._request_id, error=repr(error)[:300])
