"""The worker's part of the traces and metrics: batch intake, each request's run and stages.

Each request runs inside a `worker.request` span that continues the request's trace (from
the `trace` field the scheduler put in the batch) and links to the batch's `receive` span.
When the final record is stored, the stages are recorded from the runner's own clock
readings: `batch_transit` (batch formed -> run starts), `prefill` (-> first token),
`decode` (-> last token flushed), `result_publish` (-> the final record is sent; the instant
rides in its headers, and the edge's `deliver` stage begins there). The GenAI latency
metrics are observed from the same `Timings` the `chat.done` record carries.
"""

from __future__ import annotations

import contextvars
import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

from shared import semconv
from shared.messages import Batch, DoneResult, ErrorCode, ErrorResult, QueuedRequest
from shared.metrics import worker_metrics
from shared.telemetry import (
    SENT_AT_HEADER,
    Headers,
    context_from,
    extract,
    inject,
    ns,
    record_span,
    span_context_of,
    tracer,
)

T = TypeVar("T")

_RECEIVED_KEEP = 1024  # batch receive spans remembered for the requests' links


@dataclass
class _Run:
    """What the stages of the request being run need from its batch and its final record."""

    formed_at: float
    incoming: Context
    final_sent_at: float | None = None


_run: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("tokenbus_run", default=None)
_received: OrderedDict[str, SpanContext] = OrderedDict()


def batch_received(batch: Batch, record: Any, consumer: Any, topic_partition: Any) -> None:
    """A batch record was read: count it, and record its `receive` span in the batch's trace."""
    metrics = worker_metrics()
    metrics.lag.observe_record(consumer, record, topic_partition)
    metrics.batches.labels(batch.tier.value).inc()
    now = ns(time.time())
    span = tracer().start_span(
        semconv.messaging_span_name(semconv.SPAN_BATCH_RECEIVE, record.topic),
        context=extract(record.headers),
        kind=SpanKind.CONSUMER,
        start_time=now,
        links=[
            Link(ctx, {semconv.REQUEST_ID: r.request_id})
            for r in batch.requests
            if (ctx := span_context_of(context_from(r.trace))).is_valid
        ],
        attributes={
            semconv.MESSAGING_SYSTEM: semconv.MESSAGING_SYSTEM_KAFKA,
            semconv.MESSAGING_DESTINATION_NAME: record.topic,
            semconv.MESSAGING_OPERATION_TYPE: "receive",
            semconv.MESSAGING_BATCH_MESSAGE_COUNT: len(batch.requests),
            semconv.MESSAGING_KAFKA_OFFSET: record.offset,
            semconv.BATCH_ID: batch.batch_id,
            semconv.BATCH_SIZE: len(batch.requests),
            semconv.TIER: batch.tier.value,
        },
    )
    span.end(end_time=now)
    _received[batch.batch_id] = span.get_span_context()
    while len(_received) > _RECEIVED_KEEP:
        _received.popitem(last=False)


async def run_traced(request: QueuedRequest, batch: Batch, run: Awaitable[T]) -> T:
    """Await `run` (one request of `batch`) inside its `worker.request` span.

    Inside, the current context is the request's: log lines carry its trace id, and
    `carrier()` gives the headers an engine (vLLM) forwards.
    """
    incoming = context_from(request.trace)
    received = _received.get(batch.batch_id)
    tier = request.tier.value
    # This coroutine runs as its own task (gather), so the context set here is its own.
    _run.set(_Run(batch.formed_at, incoming))
    with tracer().start_as_current_span(
        semconv.SPAN_WORKER_REQUEST,
        context=incoming,
        kind=SpanKind.CONSUMER,
        links=[Link(received)] if received is not None and received.is_valid else [],
        attributes={
            semconv.GEN_AI_OPERATION_NAME: "chat",
            semconv.REQUEST_ID: request.request_id,
            semconv.REQUEST_ATTEMPT: request.attempt,
            semconv.TIER: tier,
            semconv.BATCH_ID: batch.batch_id,
            semconv.BATCH_SIZE: len(batch.requests),
            semconv.GEN_AI_REQUEST_MAX_TOKENS: request.effective_max_tokens,
            semconv.GEN_AI_REQUEST_TEMPERATURE: request.temperature,
            semconv.GEN_AI_REQUEST_TOP_P: request.top_p,
        },
    ) as span:
        try:
            outcome = await run
        except Exception:
            worker_metrics().requests.labels(tier, "failed").inc()
            span.set_attribute(semconv.RUN_OUTCOME, "failed")
            raise
        span.set_attribute(semconv.RUN_OUTCOME, str(outcome))
        if outcome == "handed_back":
            worker_metrics().requests.labels(tier, "handed_back").inc()
        return outcome


def final_record_headers() -> Headers:
    """Headers of a request's final result record: its trace context and when it was sent."""
    now = time.time()
    run = _run.get()
    if run is not None:
        run.final_sent_at = now
    return inject([(SENT_AT_HEADER, repr(now).encode())])


def observe_answered(
    request: QueuedRequest,
    *,
    started: float,
    first_token_at: float | None,
    done_at: float,
    final: DoneResult | ErrorResult,
) -> None:
    """The final record is stored: record the request's worker stages and its metrics."""
    tier = request.tier.value
    run = _run.get()
    sent = run.final_sent_at if run is not None and run.final_sent_at is not None else done_at
    span = trace.get_current_span()
    common = {semconv.REQUEST_ID: request.request_id, semconv.TIER: tier}
    if run is not None:
        record_span(
            semconv.stage_span_name(semconv.STAGE_BATCH_TRANSIT),
            start=run.formed_at,
            end=started,
            context=run.incoming,
            attributes={semconv.STAGE: semconv.STAGE_BATCH_TRANSIT, **common},
        )
    here = trace.set_span_in_context(span) if span.get_span_context().is_valid else None
    first = first_token_at if first_token_at is not None else done_at
    stages = (
        (semconv.STAGE_PREFILL, started, first),
        (semconv.STAGE_DECODE, first, done_at),
        (semconv.STAGE_RESULT_PUBLISH, done_at, sent),
    )
    for stage, start, end in stages:
        record_span(
            semconv.stage_span_name(stage),
            start=start,
            end=end,
            context=here,
            attributes={semconv.STAGE: stage, **common},
        )
    metrics = worker_metrics()
    if isinstance(final, DoneResult):
        metrics.observe_done(
            tier,
            final.timings,
            final.finish_reason,
            final.usage.prompt_tokens,
            final.usage.completion_tokens,
        )
        span.set_attributes(
            {
                semconv.GEN_AI_RESPONSE_FINISH_REASONS: [final.finish_reason],
                semconv.GEN_AI_USAGE_INPUT_TOKENS: final.usage.prompt_tokens,
                semconv.GEN_AI_USAGE_OUTPUT_TOKENS: final.usage.completion_tokens,
                semconv.QUEUE_MS: final.timings.queue_ms,
                semconv.TTFT_MS: final.timings.ttft_ms,
                semconv.TOTAL_MS: final.timings.total_ms,
            }
        )
    else:
        metrics.requests.labels(tier, final.code.value).inc()
        span.set_attribute(semconv.ERROR_TYPE, final.code.value)
        if final.code is not ErrorCode.cancelled:  # a cancel is the client's wish, not a fault
            span.set_status(Status(StatusCode.ERROR))


def observe_capacity(running: int, total: int) -> None:
    worker_metrics().observe_capacity(running, total)
