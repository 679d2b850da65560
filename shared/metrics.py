"""Prometheus metrics of every service (served by the edge's app, else `shared.health`).

Latency names follow the OpenTelemetry GenAI server metrics (`gen_ai.server.*`, seconds)
as Prometheus spells them; everything else is `tokenbus_*`. Each service builds its own set
once (`*_metrics()`), so a service's `/metrics` shows only what it measures. The numbers a
client sees in `chat.done.timings` are observed here from the same `Timings` object.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from shared.messages import Timings

# OTel GenAI semantic conventions' advised bucket boundaries (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)  # fmt: skip
# Kafka hops and stage waits: sub-millisecond to seconds.
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


# What a label value read from requests shows once `LabelValues` has seen its limit.
OTHER = "other"


class LabelValues:
    """At most `limit` distinct values of one label, the first come; later ones read as
    `OTHER`. Every label value taken from a request (a model's name, a variant) passes
    through one: each distinct value is a time series kept for ever, so a client naming a
    new model per request would grow every scraper and this process without bound
    (issue 37, Low)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) >= self.limit:
            return OTHER
        self._seen.add(value)
        return value


class _Record(Protocol):
    """What the lag metrics read of a consumed Kafka record (aiokafka's ConsumerRecord)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def timestamp(self) -> int: ...


class _Consumer(Protocol):
    def highwater(self, partition: Any) -> int | None: ...


@dataclass
class ConsumerLag:
    """Consumer lag per topic: records behind the log end, and how long records sat there."""

    records: Gauge
    delay: Histogram
    _next: dict[Any, int] = field(default_factory=dict)

    @classmethod
    def build(cls, registry: CollectorRegistry) -> ConsumerLag:
        return cls(
            Gauge(
                "tokenbus_consumer_lag_records",
                "Records between this consumer's position and the log end, per topic.",
                ["topic"],
                registry=registry,
            ),
            Histogram(
                "tokenbus_consumer_record_delay_seconds",
                "From a record's create time to this consumer reading it, per topic.",
                ["topic"],
                buckets=WAIT_BUCKETS,
                registry=registry,
            ),
        )

    def observe(
        self,
        consumer: _Consumer,
        fetched: Mapping[Any, Sequence[_Record]],
        now: float | None = None,
    ) -> None:
        """Call after each fetch with what it returned (aiokafka `getmany`)."""
        now = time.time() if now is None else now
        for tp, records in fetched.items():
            if not records:
                continue
            # One partition's records share a topic: its labelled child is looked up once.
            delay = self.delay.labels(records[0].topic)
            for record in records:
                delay.observe(max(0.0, now - record.timestamp / 1000))
            self._next[tp] = records[-1].offset + 1
        by_topic: dict[str, int] = {}
        # After a rebalance, a revoked partition's lag is its new owner's to report (and
        # aiokafka's highwater() asserts on a partition no longer assigned).
        assignment = getattr(consumer, "assignment", None)
        owned = set(assignment()) if callable(assignment) else None
        for tp, position in list(self._next.items()):
            if owned is not None and tp not in owned:
                del self._next[tp]
                continue
            end = consumer.highwater(tp)
            if end is not None:
                by_topic[tp.topic] = by_topic.get(tp.topic, 0) + max(0, end - position)
        for topic, lag in by_topic.items():
            self.records.labels(topic).set(lag)

    def observe_record(self, consumer: _Consumer, record: _Record, tp: Any) -> None:
        """One record at a time, for a reader that hands records on singly."""
        self.observe(consumer, {tp: [record]})


@dataclass
class EdgeRequestMetrics:
    requests: Counter
    responses: Counter
    in_flight: Gauge
    duration: Histogram
    first_delta: Histogram
    delivery: Histogram
    lag: ConsumerLag

    @classmethod
    def build(cls, registry: CollectorRegistry = REGISTRY) -> EdgeRequestMetrics:
        return cls(
            Counter(
                "tokenbus_edge_requests",
                "Chat requests the edge accepted and wrote to the requests topic.",
                ["tier"],
                registry=registry,
            ),
            Counter(
                "tokenbus_edge_responses",
                "Final frames written to clients, by outcome (finish reason or error code).",
                ["tier", "outcome"],
                registry=registry,
            ),
            Gauge(
                "tokenbus_edge_requests_in_flight",
                "Requests accepted whose final frame is not written yet.",
                registry=registry,
            ),
            Histogram(
                "tokenbus_edge_request_duration_seconds",
                "Client-facing end-to-end time: request frame received -> final frame written.",
                ["tier"],
                buckets=DURATION_BUCKETS,
                registry=registry,
            ),
            Histogram(
                "tokenbus_edge_time_to_first_delta_seconds",
                "Request frame received -> first chat.delta written.",
                ["tier"],
                buckets=TTFT_BUCKETS,
                registry=registry,
            ),
            Histogram(
                "tokenbus_edge_delivery_seconds",
                "Final result record written by the worker -> its frame written to the socket.",
                ["tier"],
                buckets=WAIT_BUCKETS,
                registry=registry,
            ),
            ConsumerLag.build(registry),
        )


@dataclass
class IngestMetrics:
    records: Counter
    admit: Histogram
    lag: ConsumerLag

    @classmethod
    def build(cls, registry: CollectorRegistry = REGISTRY) -> IngestMetrics:
        return cls(
            Counter(
                "tokenbus_ingest_records",
                "Request records handled, by outcome (admitted|cached|rejected|duplicate)"
                " and tier.",
                ["outcome", "tier"],
                registry=registry,
            ),
            Histogram(
                "tokenbus_ingest_admit_seconds",
                "Request record created -> admitted to its tier topic (the admit stage).",
                ["tier"],
                buckets=WAIT_BUCKETS,
                registry=registry,
            ),
            ConsumerLag.build(registry),
        )


@dataclass
class SchedulerMetrics:
    queue_depth: Gauge
    queue_wait: Histogram
    batch_size: Histogram
    fill_ratio: Histogram
    batches: Counter
    expired: Counter
    lag: ConsumerLag
    fallbacks: Counter
    variant_requests: Counter
    variant_fallbacks: Counter
    variant_share: Gauge
    model_queue_depth: Gauge

    @classmethod
    def build(cls, registry: CollectorRegistry = REGISTRY) -> SchedulerMetrics:
        return cls(
            Gauge(
                "tokenbus_tier_queue_depth",
                "Requests read from a tier topic and waiting for a bus.",
                ["tier"],
                registry=registry,
            ),
            Histogram(
                "tokenbus_tier_queue_wait_seconds",
                "Admitted to the tier topic -> its bus leaves (the queue_wait stage).",
                ["tier"],
                buckets=WAIT_BUCKETS,
                registry=registry,
            ),
            Histogram(
                "tokenbus_batch_size",
                "Requests per dispatched batch.",
                ["tier"],
                buckets=BATCH_SIZE_BUCKETS,
                registry=registry,
            ),
            Histogram(
                "tokenbus_batch_fill_ratio",
                "Batch size over the tier's largest batch.",
                ["tier"],
                buckets=RATIO_BUCKETS,
                registry=registry,
            ),
            Counter(
                "tokenbus_batches",
                "Batches dispatched, by why the bus left (full|timeout|...).",
                ["tier", "reason"],
                registry=registry,
            ),
            Counter(
                "tokenbus_scheduler_expired",
                "Requests answered deadline_exceeded instead of being run.",
                ["tier"],
                registry=registry,
            ),
            ConsumerLag.build(registry),
            Counter(
                "tokenbus_scheduler_fallbacks",
                "Requests moved to their fallback model (their own model's backlog would"
                " have missed their deadline), by the model they moved to.",
                ["tier", "model"],
                registry=registry,
            ),
            Counter(
                "tokenbus_scheduler_variant_requests",
                "Requests queued for a variant of their model by its rollout (baseline: the"
                " model's workers without one; ADR 0054).",
                ["model", "variant"],
                registry=registry,
            ),
            Counter(
                "tokenbus_scheduler_variant_fallbacks",
                "Requests moved from a variant without a live worker to their model's baseline.",
                ["model", "variant"],
                registry=registry,
            ),
            Gauge(
                "tokenbus_scheduler_variant_share_percent",
                "Each variant's share of its model's conversations, as the rollout sets it.",
                ["model", "variant"],
                registry=registry,
            ),
            Gauge(
                "tokenbus_model_queue_depth",
                'Requests waiting in this scheduler for a worker of each model (model "":'
                " those that run on any worker): each model's scaling signal.",
                ["model"],
                registry=registry,
            ),
        )


@dataclass
class WorkerMetrics:
    ttft: Histogram
    tpot: Histogram
    duration: Histogram
    queue: Histogram
    tokens: Counter
    tokens_per_second: Gauge
    requests: Counter
    batches: Counter
    slots_in_use: Gauge
    slots_total: Gauge
    lag: ConsumerLag
    engine_cpu: Counter
    prefix_cache_hit_rate: Gauge
    _output_tokens: float = 0.0
    _rate_mark: tuple[float, float] | None = None  # (time, output tokens) at the last sample

    @classmethod
    def build(cls, registry: CollectorRegistry = REGISTRY) -> WorkerMetrics:
        return cls(
            Histogram(
                "gen_ai_server_time_to_first_token_seconds",
                "Request created -> first token generated (chat.done ttft_ms).",
                ["tier"],
                buckets=TTFT_BUCKETS,
                registry=registry,
            ),
            Histogram(
                "gen_ai_server_time_per_output_token_seconds",
                "Decode time per output token after the first (inter-token latency).",
                ["tier"],
                buckets=TPOT_BUCKETS,
                registry=registry,
            ),
            Histogram(
                "gen_ai_server_request_duration_seconds",
                "Request created -> last token generated (chat.done total_ms).",
                ["tier"],
                buckets=DURATION_BUCKETS,
                registry=registry,
            ),
            Histogram(
                "tokenbus_request_queue_seconds",
                "Request created -> a worker starts it (chat.done queue_ms).",
                ["tier"],
                buckets=WAIT_BUCKETS,
                registry=registry,
            ),
            Counter(
                "tokenbus_worker_tokens",
                "Tokens processed, by type (input|output).",
                ["tier", "type"],
                registry=registry,
            ),
            Gauge(
                "tokenbus_worker_output_tokens_per_second",
                "Output tokens per second over the last heartbeat interval.",
                registry=registry,
            ),
            Counter(
                "tokenbus_worker_requests",
                "Requests run, by outcome (stop|length|cancelled|handed_back|escalated|failed).",
                ["tier", "outcome"],
                registry=registry,
            ),
            Counter("tokenbus_worker_batches", "Batches taken.", ["tier"], registry=registry),
            Gauge("tokenbus_worker_slots_in_use", "Sequences running now.", registry=registry),
            Gauge(
                "tokenbus_worker_slots_capacity",
                "Sequences the engine runs at once.",
                registry=registry,
            ),
            ConsumerLag.build(registry),
            Counter(
                "tokenbus_worker_engine_cpu_seconds",
                "CPU time the engine's own steps took in the worker process (sim engine; 0 for"
                " engines that run elsewhere): the worker's CPU less this is the pipeline's.",
                registry=registry,
            ),
            Gauge(
                "tokenbus_worker_prefix_cache_hit_rate",
                "Share of recent prompt tokens the engine found in its prefix cache (sim: last"
                " 1000 requests; vllm: its own prefix-cache stats).",
                registry=registry,
            ),
        )

    def observe_done(
        self, tier: str, timings: Timings, finish_reason: str, input_tokens: int, output_tokens: int
    ) -> None:
        """One answered request, from the very `Timings` its `chat.done` carries."""
        self.ttft.labels(tier).observe(timings.ttft_ms / 1000)
        self.duration.labels(tier).observe(timings.total_ms / 1000)
        self.queue.labels(tier).observe(timings.queue_ms / 1000)
        if output_tokens > 1:
            decode_s = (timings.total_ms - timings.ttft_ms) / 1000
            self.tpot.labels(tier).observe(max(0.0, decode_s) / (output_tokens - 1))
        self.count_tokens(tier, input_tokens, output_tokens)
        self.requests.labels(tier, finish_reason).inc()

    def count_tokens(self, tier: str, input_tokens: int, output_tokens: int) -> None:
        self.tokens.labels(tier, "input").inc(input_tokens)
        self.tokens.labels(tier, "output").inc(output_tokens)
        self._output_tokens += output_tokens

    def observe_capacity(self, running: int, total: int, now: float | None = None) -> None:
        """At each heartbeat: slots in use, and output tokens/s since the previous one."""
        now = time.monotonic() if now is None else now
        self.slots_in_use.set(running)
        self.slots_total.set(total)
        if self._rate_mark is not None:
            then, tokens = self._rate_mark
            if now > then:
                self.tokens_per_second.set((self._output_tokens - tokens) / (now - then))
        self._rate_mark = (now, self._output_tokens)


# One set per process, on the default registry (which also carries process_* metrics).
@functools.cache
def edge_metrics() -> EdgeRequestMetrics:
    return EdgeRequestMetrics.build()


@functools.cache
def ingest_metrics() -> IngestMetrics:
    return IngestMetrics.build()


@functools.cache
def scheduler_metrics() -> SchedulerMetrics:
    return SchedulerMetrics.build()


@functools.cache
def worker_metrics() -> WorkerMetrics:
    return WorkerMetrics.build()
