"""The scores reader: shadow validation's scores (shared/shadows.py), from the scores topic
into per-variant quality metrics and the canary judge (ADR 0057).

Every scheduler reads every partition of the topic (its own consumer, no group) from the
scores stored in the last canary window before it started (`rewind`): a score is a sample
of the recent past, the windows it feeds are no older than their width, and a restarted
scheduler judges on the evidence its predecessor had rather than on none. Scores made
before this process started feed the windows but not the metrics (its predecessor counted
them). A topic made after the scheduler started is found by the consumer's metadata
refresh. A record that cannot be read is logged and skipped (nobody waits on a score).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from pydantic import ValidationError

from shared.fetches import fetches
from shared.messages import error_message
from shared.records import read
from shared.shadows import ShadowScore
from shared.variants import BASELINE

log = structlog.get_logger()

FETCH_MS = 1000  # longest one getmany waits
ASSIGNED_WITHIN_S = 10.0  # the rewind waits this long for the consumer's partitions
# Quality is 0-1; exact-match scores are 0 or 1, ROUGE-L ones anywhere between.
QUALITY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)

OnScore = Callable[[ShadowScore], None]


@dataclass(frozen=True)
class ScoreMetrics:
    """Observes the scores; it never sends or rewrites. Caller: `ScoreReader`."""

    quality: Histogram
    scores: Counter
    embedding: Histogram

    @classmethod
    def build(cls, registry: CollectorRegistry = REGISTRY) -> ScoreMetrics:
        return cls(
            Histogram(
                "tokenbus_scheduler_shadow_quality",
                "Shadow validation: quality (agreement with the gold variant's answer to the same"
                " request, 0-1: exact match if deterministic, else the embedding similarity"
                " where the gold worker has an embedding model, else ROUGE-L) of each"
                " variant's sampled answers (variant `baseline`: the workers without one).",
                ["model", "variant"],
                buckets=QUALITY_BUCKETS,
                registry=registry,
            ),
            Counter(
                "tokenbus_scheduler_shadow_scores",
                "Shadow validation: scores read, per variant, gold and whether the two"
                " answers matched exactly (whitespace aside).",
                ["model", "variant", "gold", "exact"],
                registry=registry,
            ),
            Histogram(
                "tokenbus_scheduler_shadow_embedding",
                "Shadow validation: the cosine similarity of the embeddings of each variant's"
                " sampled answer and the gold's (shared/embeddings.py); only scores made by a"
                " gold worker with an embedding model.",
                ["model", "variant"],
                buckets=QUALITY_BUCKETS,
                registry=registry,
            ),
        )

    def observe(self, score: ShadowScore) -> None:
        variant = score.variant or BASELINE
        self.quality.labels(score.model, variant).observe(score.quality)
        exact = "true" if score.exact else "false"
        self.scores.labels(score.model, variant, score.gold, exact).inc()
        if score.embedding is not None:
            self.embedding.labels(score.model, variant).observe(score.embedding)


@functools.cache
def score_metrics() -> ScoreMetrics:
    """One set per process, on the default registry."""
    return ScoreMetrics.build()


def parse(value: bytes | None) -> ShadowScore | str:
    """The score a record holds, or why it holds none."""
    try:
        return read(ShadowScore, value or b"")
    except ValidationError as exc:
        return error_message(exc)


class ScoreReader:
    """Feeds each score to the metrics and `on_score` (the canary judge's windows).

    Owner of `consumer` (subscribed to the scores topic, no group, from its end). Caller: the
    scheduler (`run`, as a task for the process's life).
    """

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        on_score: OnScore,
        metrics: ScoreMetrics | None = None,
        *,
        rewind_s: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._consumer = consumer
        self._on_score = on_score
        self._metrics = metrics or score_metrics()
        self._rewind_s = rewind_s  # how far back the first read starts (the canary window)
        self._clock = clock
        self._started_at = clock()

    async def run(self) -> None:
        if self._rewind_s > 0:
            await self.rewind()
        async for fetched in fetches(self._consumer, what="scores", timeout_ms=FETCH_MS):
            for records in fetched.values():
                for record in records:
                    score = parse(record.value)
                    if isinstance(score, str):
                        log.error("score.invalid", offset=record.offset, error=score)
                        continue
                    if score.scored_at >= self._started_at:
                        self._metrics.observe(score)
                    self._on_score(score)

    async def rewind(self) -> None:
        """Start each partition at the first score stored in the last `rewind_s` seconds;
        where that cannot be found (no partitions yet, the broker away), read from the end,
        as before, and say so."""
        for _ in range(int(ASSIGNED_WITHIN_S / 0.1)):
            if self._consumer.assignment():  # its partitions come with its first metadata
                break
            await asyncio.sleep(0.1)  # aiokafka offers no event for a group-less assignment
        partitions = self._consumer.assignment()
        since_ms = int((self._clock() - self._rewind_s) * 1000)
        try:
            async with asyncio.timeout(ASSIGNED_WITHIN_S):
                found = await self._consumer.offsets_for_times(dict.fromkeys(partitions, since_ms))
        except (KafkaError, TimeoutError) as exc:
            log.warning("scores.rewind_failed", error=repr(exc))
            return
        for tp, at in found.items():
            if at is not None:
                self._consumer.seek(tp, at.offset)
        log.info(
            "scores.rewound",
            seconds=self._rewind_s,
            partitions=len(partitions),
            from_offsets={tp.partition: at.offset for tp, at in found.items() if at is not None},
        )
