"""The scores reader: shadow validation's scores (shared/shadows.py), from the scores topic
into per-variant quality metrics and the canary judge (ADR 0057).

Every scheduler reads every partition of the topic (its own consumer, no group) from where
it ends when the scheduler starts: a score is a sample of the recent past, and the canary
windows it feeds are no older than their width. A topic made after the scheduler started
is found by the consumer's metadata refresh. A record that cannot be read is logged and
skipped (nothing is answered for it: nobody waits on a score).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from pydantic import ValidationError

from shared.fetches import fetches
from shared.messages import error_message
from shared.shadows import ShadowScore
from shared.variants import BASELINE

log = structlog.get_logger()

FETCH_MS = 1000  # longest one getmany waits
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
        return ShadowScore.model_validate_json(value or b"")
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
    ) -> None:
        self._consumer = consumer
        self._on_score = on_score
        self._metrics = metrics or score_metrics()

    async def run(self) -> None:
        async for fetched in fetches(self._consumer, what="scores", timeout_ms=FETCH_MS):
            for records in fetched.values():
                for record in records:
                    score = parse(record.value)
                    if isinstance(score, str):
                        log.error("score.invalid", offset=record.offset, error=score)
                        continue
                    self._metrics.observe(score)
                    self._on_score(score)
