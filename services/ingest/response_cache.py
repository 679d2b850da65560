"""The response cache: which requests it may answer, their key, the bounded map, its replay.

Workers store complete deterministic answers on the compacted cache topic; every ingest
replica reads that topic from its start into a bounded in-memory map (`CacheFollower`) and
then follows it, so each replica answers from the same cache and a restarted one still
does. A hit is replayed as the request's own result stream (`replay`): the deltas as the
worker sent them, then `done` marked `cached`. See docs/decisions/0036-response-cache.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from pydantic import ValidationError

from shared.messages import (
    SAMPLING_FIELDS,
    CacheEntry,
    DeltaResult,
    DoneResult,
    QueuedRequest,
    RequestRecord,
    Timings,
)
from shared.records import read
from shared.results import Result

log = structlog.get_logger()

# What decides a deterministic answer. `model` is in the set for deployments whose requests
# name one (an absent field is left out of the dump). `tenant` keeps one tenant from
# learning what another asked (a hit is visible in `cached` and in its latency): vLLM
# salts its prefix cache per tenant (`cache_salt`) for the same reason.
KEY_FIELDS = frozenset(
    {"model", "messages", "prompt", "max_tokens", "temperature", "top_p", "stop", "tenant"}
    | SAMPLING_FIELDS
)
KEY_VERSION = 2  # bumped when the key's fields or encoding change: old entries stop matching
# Python's memory for an entry beyond its text (measured with tracemalloc, ADR 0036): the
# model, its key, its map slot; per chunk a str object and a list slot.
ENTRY_OVERHEAD_BYTES = 2000
CHUNK_OVERHEAD_BYTES = 60


def cache_key(request: RequestRecord) -> str:
    """SHA-256 of a canonical JSON of the fields that decide the answer (`KEY_FIELDS`).

    An unset `max_tokens` (null: the answer runs to the end of the context) is a key of its
    own, apart from every number.
    """
    fields: dict[str, Any] = request.model_dump(mode="json", include=set(KEY_FIELDS))
    fields["v"] = KEY_VERSION
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def entry_size(entry: CacheEntry) -> int:
    """Bytes an entry holds in memory, roughly: its text plus Python's overheads."""
    return ENTRY_OVERHEAD_BYTES + sum(CHUNK_OVERHEAD_BYTES + len(c) for c in entry.chunks)


class ResponseCache:
    """Cached answers by key, bounded in count, bytes and age; least recently used go first.

    Caller: the ingest shell (`get`) and the `CacheFollower` (`put`, `drop`), both on the
    event loop. Affects: only itself.
    """

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        max_age_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._entries: OrderedDict[str, tuple[CacheEntry, int]] = OrderedDict()
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._max_age_s = max_age_s
        self._clock = clock
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, request: QueuedRequest) -> CacheEntry | None:
        """The answer stored under the request's `cache_key`, if fresh and of its model."""
        key = request.cache_key
        if key is None or (found := self._entries.get(key)) is None:
            return None
        entry = found[0]
        if self._clock() - entry.stored_at > self._max_age_s:
            self.drop(key)
            return None
        # A request that names a model is only answered by that model (never a fallback's).
        named = request.model
        if named is not None and named != entry.model:
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, entry: CacheEntry) -> None:
        """Keep `entry` (the newest for its key wins), then evict down to the bounds."""
        if self._clock() - entry.stored_at > self._max_age_s:
            self.drop(entry.key)  # read back from an old segment: past serving
            return
        size = entry_size(entry)
        if size > self._max_bytes:
            return
        self.drop(entry.key)
        self._entries[entry.key] = (entry, size)
        self.bytes += size
        while len(self._entries) > self._max_entries or self.bytes > self._max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted

    def drop(self, key: str) -> None:
        found = self._entries.pop(key, None)
        if found is not None:
            self.bytes -= found[1]


def replay(request: QueuedRequest, entry: CacheEntry, now: float) -> list[Result]:
    """The request's result stream from a cached answer: its deltas, then `done` (cached).

    The same framing a worker writes (attempt, `seq` from 0), so readers need nothing new.
    """
    attempt, rid = request.attempt, request.request_id
    records: list[Result] = [
        DeltaResult(request_id=rid, attempt=attempt, seq=seq, text=text)
        for seq, text in enumerate(entry.chunks)
    ]
    since_ms = round(max(0.0, now - request.created_at) * 1000, 3)
    records.append(
        DoneResult(
            request_id=rid,
            attempt=attempt,
            seq=len(entry.chunks),
            finish_reason=entry.finish_reason,
            usage=entry.usage,
            # No queue and no batch: the answer is whole at once.
            timings=Timings(queue_ms=since_ms, batch_size=0, ttft_ms=since_ms, total_ms=since_ms),
            model=entry.model,
            cached=True,
        )
    )
    return records


class CacheFollower:
    """Reads the cache topic into a `ResponseCache`: all of it at `load`, then as it grows.

    Owner of `consumer` (no group: every replica reads every partition) once `load`
    starts it; `follow` runs until cancelled and stops it. Records it cannot read are
    logged and skipped (invariant 7): a cache entry is only ever an optimisation.
    """

    def __init__(
        self,
        cache: ResponseCache,
        consumer: AIOKafkaConsumer,
        admin: AIOKafkaAdminClient,
        topic: str,
        retry_s: float = 5.0,
    ) -> None:
        self.cache = cache
        self._consumer = consumer
        self._admin = admin
        self._topic = topic
        self._retry_s = retry_s
        self._assigned: list[TopicPartition] = []

    async def load(self) -> int:
        """Start the consumer and read every partition up to its end now; records read.

        A missing cache topic (made by `tokenbus topics create`) or a failed read is no
        error: the cache starts with what was read, and `follow` reads the topic again.
        """
        await self._consumer.start()
        try:
            return await self._load()
        except Exception as exc:
            self._assigned = []
            log.warning("cache.load_failed", topic=self._topic, error=_describe(exc))
            return 0

    async def _load(self) -> int:
        started = time.monotonic()
        if not await self._assign():
            log.warning("cache.topic_missing", topic=self._topic)
            return 0
        ends = await self._consumer.end_offsets(self._assigned)
        todo = [tp for tp in self._assigned if ends[tp] > 0]
        read = 0
        while todo:
            read += self._take(await self._consumer.getmany(*todo, timeout_ms=500), loading=True)
            todo = [tp for tp in todo if await self._consumer.position(tp) < ends[tp]]
        log.info(
            "cache.loaded",
            records=read,
            entries=len(self.cache),
            bytes=self.cache.bytes,
            seconds=round(time.monotonic() - started, 3),
        )
        return read

    async def follow(self) -> None:
        """Take new entries as workers store them, until cancelled."""
        try:
            while True:
                try:
                    if not self._assigned and not await self._assign():
                        await asyncio.sleep(self._retry_s)
                        continue
                    self._take(await self._consumer.getmany(timeout_ms=1000), loading=False)
                except Exception as exc:
                    # The cache only spares work: a failure to read it never stops ingest.
                    log.warning("cache.follow_failed", topic=self._topic, error=_describe(exc))
                    await asyncio.sleep(self._retry_s)
        finally:
            await self._consumer.stop()

    async def _assign(self) -> bool:
        described = await self._admin.describe_topics([self._topic])
        found = [
            TopicPartition(t["topic"], p["partition"])
            for t in described
            if t.get("error_code") == 0
            for p in t["partitions"]
        ]
        if not found:
            return False
        self._consumer.assign(found)
        await self._consumer.seek_to_beginning(*found)
        self._assigned = found
        return True

    def _take(
        self, fetched: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]], *, loading: bool
    ) -> int:
        read = 0
        for records in fetched.values():
            for record in records:
                read += 1
                entry = self._apply(record)
                if entry is not None and not loading:
                    log.info("cache.added", request_id=entry.request_id, entries=len(self.cache))
        return read

    def _apply(self, record: ConsumerRecord[bytes, bytes]) -> CacheEntry | None:
        if record.value is None:
            if record.key is not None:
                self.cache.drop(record.key.decode(errors="replace"))  # a tombstone
            return None
        try:
            entry = read(CacheEntry, record.value)
        except ValidationError as exc:
            log.warning(
                "cache.record_skipped",
                partition=record.partition,
                offset=record.offset,
                error=str(exc).replace("\n", " ")[:300],
            )
            return None
        self.cache.put(entry)
        return entry


def _describe(exc: BaseException) -> str:
    text = str(exc).replace("\n", " ")
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__
