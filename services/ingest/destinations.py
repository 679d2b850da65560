"""Whether a request's `reply_to` exists and may be written, from the broker's metadata."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    InvalidTopicError,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
)

from services.ingest.admission import Reason
from shared.messages import ReplyTo


class MetadataUnavailable(Exception):
    """The broker did not answer in time: transient, the caller retries (never a verdict)."""


@dataclass(frozen=True)
class Undeliverable:
    reason: Reason
    why: str


class ReplyDestinations:
    """Checks `reply_to` topics, caching the partition count of those that exist.

    Caller: the ingest shell, one record at a time. Affects: its own cache only.
    A missing topic is asked about every time (it may be created any moment); one that
    exists is trusted for `cache_s`, and asked again when a partition looks out of range.
    """

    def __init__(
        self,
        admin: AIOKafkaAdminClient,
        timeout_s: float,
        grace_s: float = 0.0,
        cache_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._admin = admin
        self._timeout_s = timeout_s
        self._grace_s = grace_s
        self._cache_s = cache_s
        self._clock = clock
        self._partitions: dict[str, tuple[int, float]] = {}

    async def check(self, reply_to: ReplyTo) -> Undeliverable | None:
        """None when results can go there; raises MetadataUnavailable when unknown.

        A topic just created (the edge's per-request result topics) may not be known to
        every broker yet: a missing topic or partition is asked about again for `grace_s`
        before it is a verdict.
        """
        give_up = self._clock() + self._grace_s
        while True:
            verdict = await self._check(reply_to)
            if verdict is None or self._clock() >= give_up:
                return verdict
            await asyncio.sleep(min(0.05, self._grace_s))

    async def _check(self, reply_to: ReplyTo) -> Undeliverable | None:
        cached = self._partitions.get(reply_to.topic)
        fresh = cached is not None and cached[1] > self._clock()
        if cached is None or not fresh or not _in_range(reply_to, cached[0]):
            verdict = await self._describe(reply_to.topic)
            if verdict is not None:
                self._partitions.pop(reply_to.topic, None)
                return verdict
            cached = self._partitions[reply_to.topic]
        if not _in_range(reply_to, cached[0]):
            return Undeliverable(
                Reason.reply_to_partition,
                f"reply_to.partition: {reply_to.partition} is out of range:"
                f" {reply_to.topic} has {cached[0]} partitions",
            )
        return None

    def forget(self, topic: str) -> None:
        """After a failed write: ask the broker again next time."""
        self._partitions.pop(topic, None)

    async def _describe(self, topic: str) -> Undeliverable | None:
        try:
            described = await asyncio.wait_for(
                self._admin.describe_topics([topic]), self._timeout_s
            )
        except Exception as exc:
            # Any failure to get an answer is no answer: the broker may be away.
            raise MetadataUnavailable(f"{type(exc).__name__}: {exc}") from exc
        entry: dict[str, Any] = next((t for t in described if t.get("topic") == topic), {})
        code = entry.get("error_code")
        if code == UnknownTopicOrPartitionError.errno:
            return Undeliverable(Reason.reply_to_missing, f"reply_to.topic: {topic} does not exist")
        if code in (InvalidTopicError.errno, TopicAuthorizationFailedError.errno):
            return Undeliverable(
                Reason.reply_to_forbidden, f"reply_to.topic: {topic} may not be written"
            )
        if code != 0 or not entry.get("partitions"):
            raise MetadataUnavailable(f"metadata of {topic}: error code {code}")
        if entry.get("is_internal"):
            return Undeliverable(
                Reason.reply_to_forbidden, f"reply_to.topic: {topic} is internal to Kafka"
            )
        self._partitions[topic] = (len(entry["partitions"]), self._clock() + self._cache_s)
        return None


def _in_range(reply_to: ReplyTo, partitions: int) -> bool:
    return reply_to.partition is None or reply_to.partition < partitions
