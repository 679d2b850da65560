"""Turns the traces of one run (and the batches seen meanwhile) into its `RunSummary`."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from bench.loadgen import LoadConfig, LoadResult, RequestTrace
from bench.observe import ObservedBatch
from bench.report import BatchSummary, RunSummary, TierSummary
from bench.stats import distribution
from shared.messages import Tier

ALL = "all"


@dataclass(frozen=True)
class BatchJoin:
    """Where one request rode: its batch, and the services' wall-clock stamps of its trip."""

    size: int
    created_at: float  # edge
    accepted_at: float  # ingest
    formed_at: float  # scheduler

    @property
    def wait_ms(self) -> float:
        return max(0.0, (self.formed_at - self.accepted_at) * 1000)


# The legs of one request's TTFT, in order; they add up to the TTFT the client saw.
HOPS = (
    "client_to_edge",  # WebSocket frame in, edge stamps created_at
    "edge_to_ingest",  # edge produce, Kafka, ingest consume, validate (accepted_at)
    "ingest_to_batch",  # ingest produce, Kafka, scheduler consume, bus wait (formed_at)
    "batch_to_worker",  # scheduler produce, Kafka, worker consume, runner start
    "engine_first_token",  # engine: queue for a slot, prefill, first decode step
    "first_token_to_client",  # coalescing hold, produce, Kafka, edge consume, WebSocket out
)


@dataclass(frozen=True)
class RunContext:
    policy: str
    offered_rps: float
    duration_s: float
    seed: int
    # Largest batch the scheduler may form per tier (direct: the engine's sequence slots).
    max_batch_size: dict[str, int]
    # Direct baseline: nothing batches requests before the engine, so batch wait is zero.
    no_batch_wait: bool = False


def summarise(
    context: RunContext,
    config: LoadConfig,
    result: LoadResult,
    batches: list[ObservedBatch] | None,
) -> RunSummary:
    traces = result.traces
    ours = {t.request_id for t in traces if t.request_id is not None}
    # Batches still draining from an earlier run hold none of this run's requests.
    batches = [b for b in batches or [] if any(r.request_id in ours for r in b.requests)]
    joins = _joins(batches)
    sent = [t for t in traces if t.sent_at is not None]
    completed = [t for t in sent if t.completed]
    tokens = sum(t.completion_tokens or 0 for t in completed)
    elapsed = max(1e-9, result.ended_at - result.started_at)
    tiers = {
        tier.value: _tier([t for t in traces if t.planned.tier is tier], joins, context)
        for tier in Tier
    }
    tiers[ALL] = _tier(traces, joins, context)
    return RunSummary(
        policy=context.policy,
        offered_rps=context.offered_rps,
        duration_s=context.duration_s,
        seed=context.seed,
        connections=config.connections,
        concurrency_cap=config.concurrency_cap,
        sent=len(sent),
        completed=len(completed),
        shed=sum(t.shed for t in traces),
        incomplete=sum(not t.finished for t in sent),
        errors=dict(Counter(t.error_code for t in sent if t.error_code is not None)),
        elapsed_s=_r(elapsed),
        achieved_rps=_r(len(completed) / elapsed),
        output_tokens_per_s=_r(tokens / elapsed),
        tiers=tiers,
        batches=_batch_summary(batches, completed, context),
        generator_lag_ms=distribution(t.lag_s * 1000 for t in traces),
        load_avg_1m=round(os.getloadavg()[0], 2),
        ttft_samples_ms={
            tier.value: sorted(
                round(v, 1)
                for t in traces
                if t.planned.tier is tier
                if (v := _ttft_ms(t)) is not None
            )
            for tier in Tier
        },
    )


def _tier(traces: list[RequestTrace], joins: dict[str, BatchJoin], ctx: RunContext) -> TierSummary:
    sent = [t for t in traces if t.sent_at is not None]
    done = [t for t in sent if t.completed]
    engine: list[float] = []
    waits: list[float] = []
    overheads: list[float] = []
    hops: dict[str, list[float]] = {hop: [] for hop in HOPS}
    for t in done:
        legs = _hops_ms(t, joins.get(t.request_id or ""))
        for hop, value in (legs or {}).items():
            hops[hop].append(value)
        ttft = _ttft_ms(t)
        engine_ms = _engine_ttft_ms(t)
        wait_ms = _batch_wait_ms(t, joins, ctx)
        if engine_ms is not None:
            engine.append(engine_ms)
        if wait_ms is not None:
            waits.append(wait_ms)
        if ttft is not None and engine_ms is not None and wait_ms is not None:
            overheads.append(ttft - engine_ms - wait_ms)
    return TierSummary(
        sent=len(sent),
        completed=len(done),
        errors=sum(t.error_code is not None for t in sent),
        incomplete=sum(not t.finished for t in sent),
        output_tokens=sum(t.completion_tokens or 0 for t in done),
        ttft_ms=distribution(v for t in done if (v := _ttft_ms(t)) is not None),
        itl_ms=distribution(
            (b - a) * 1000 for t in done for a, b in zip(t.delta_at, t.delta_at[1:], strict=False)
        ),
        tpot_ms=distribution(v for t in done if (v := _tpot_ms(t)) is not None),
        e2e_ms=distribution(
            (t.done_at - t.sent_at) * 1000
            for t in done
            if t.done_at is not None and t.sent_at is not None
        ),
        engine_ttft_ms=distribution(engine),
        batch_wait_ms=distribution(waits),
        overhead_ms=distribution(overheads),
        hops_ms={hop: distribution(values) for hop, values in hops.items() if values},
    )


def _ttft_ms(t: RequestTrace) -> float | None:
    if not t.completed or not t.delta_at or t.sent_at is None:
        return None
    return (t.delta_at[0] - t.sent_at) * 1000


def _tpot_ms(t: RequestTrace) -> float | None:
    n = t.completion_tokens or 0
    if n < 2 or len(t.delta_at) < 1:
        return None
    return (t.delta_at[-1] - t.delta_at[0]) * 1000 / (n - 1)


def _engine_ttft_ms(t: RequestTrace) -> float | None:
    """Worker-side time from taking the request to the engine's first token."""
    ttft, queue = t.timings.get("ttft_ms"), t.timings.get("queue_ms")
    if not isinstance(ttft, int | float) or not isinstance(queue, int | float):
        return None
    return float(ttft) - float(queue)


def _batch_wait_ms(t: RequestTrace, joins: dict[str, BatchJoin], ctx: RunContext) -> float | None:
    stamped = t.timings.get("batch_wait_ms")
    if isinstance(stamped, int | float):  # the scheduler's own stamp wins where it exists
        return float(stamped)
    if ctx.no_batch_wait:
        return 0.0
    join = joins.get(t.request_id or "")
    return None if join is None else join.wait_ms


def _joins(batches: list[ObservedBatch]) -> dict[str, BatchJoin]:
    return {
        r.request_id: BatchJoin(len(b.requests), r.created_at, r.accepted_at, b.formed_at)
        for b in batches
        for r in b.requests
    }


def _hops_ms(t: RequestTrace, join: BatchJoin | None) -> dict[str, float] | None:
    """TTFT cut at each service's stamp (one machine, one wall clock), or None if unknown."""
    ttft = t.timings.get("ttft_ms")
    queue = t.timings.get("queue_ms")
    if (
        join is None
        or t.sent_wall is None
        or t.sent_at is None
        or not t.delta_at
        or not isinstance(ttft, int | float)
        or not isinstance(queue, int | float)
    ):
        return None
    first_delta = t.sent_wall + (t.delta_at[0] - t.sent_at)
    worker_start = join.created_at + queue / 1000
    first_token = join.created_at + ttft / 1000
    marks = (
        t.sent_wall,
        join.created_at,
        join.accepted_at,
        join.formed_at,
        worker_start,
        first_token,
        first_delta,
    )
    return {hop: (b - a) * 1000 for hop, a, b in zip(HOPS, marks[:-1], marks[1:], strict=True)}


def _batch_summary(
    batches: list[ObservedBatch], completed: list[RequestTrace], ctx: RunContext
) -> BatchSummary:
    if batches:
        sizes = [(b.tier, len(b.requests)) for b in batches]
        reasons = Counter(b.reason for b in batches)
        source, counts = "scheduler", "batches"
    else:
        sizes = [
            (t.planned.tier.value, s)
            for t in completed
            if isinstance(s := t.timings.get("batch_size"), int) and s > 0
        ]
        reasons = Counter()
        source, counts = ("timings" if sizes else "none"), "requests"
    fills = [
        size / ctx.max_batch_size[tier] for tier, size in sizes if ctx.max_batch_size.get(tier)
    ]
    histogram: dict[str, dict[str, int]] = {}
    for (tier, size), n in sorted(Counter(sizes).items(), key=lambda item: item[0][1]):
        histogram.setdefault(tier, {})[str(size)] = n
    return BatchSummary(
        source=source,
        counts=counts,
        batches=len(batches),
        size=distribution(size for _, size in sizes),
        fill=distribution(fills),
        histogram=histogram,
        reasons=dict(reasons),
    )


def _r(value: float) -> float:
    return round(value, 3)
