"""The worker's part of the traces and metrics: batch intake, each request's run and stages.

It only observes: it returns contexts and headers for the caller to attach, and never
writes or changes a record. Each request runs inside a `worker.request` span that
continues the request's trace (from the `trace` field the scheduler put in the batch) and
links to the batch's `receive` span. When the final record is stored, the stages are
recorded from the run's own clock readings (`RequestState`): `batch_transit` (batch formed
-> run starts), `prefill` (-> first token), `decode` (-> last token flushed),
`result_publish` (-> the final record is sent; the instant rides in its headers, and the
edge's `deliver` stage begins there). The GenAI latency metrics are observed from the same
`Timings` the `chat.done` record carries.

Spans cost only where they are recorded: with no tracer provider installed (no trace
directory, no OTLP endpoint) no span is built, and the request's incoming context is
carried on as it came (logs, the engine and the final record still carry its trace id).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode

from services.worker.outcomes import OutcomeCounts
from services.worker.request_state import RequestState
from shared import semconv
from shared.messages import Batch, DoneResult, ErrorCode, ErrorResult, QueuedRequest
from shared.metrics import WorkerMetrics, worker_metrics
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

RECEIVED_KEPT = 1024  # batch receive spans remembered for the requests' links


def sampling_attributes(request: QueuedRequest) -> dict[str, float]:
    """The request's max_tokens, temperature and top_p as span attributes, where it sets
    them."""
    attributes = {
        semconv.GEN_AI_REQUEST_MAX_TOKENS: request.max_tokens,
        semconv.GEN_AI_REQUEST_TEMPERATURE: request.temperature,
        semconv.GEN_AI_REQUEST_TOP_P: request.top_p,
    }
    return {k: v for k, v in attributes.items() if v is not None}


def tracing_on() -> bool:
    """Whether this process records spans (a tracer provider was installed at start-up)."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


@dataclass(frozen=True)
class RunTrace:
    """One request's run as traced: the context to carry on, and its span (if recorded)."""

    context: Context
    span: Span | None


class WorkerTelemetry:
    """Caller: the worker's batch loop (`batch_received`, `run`), its runner and heartbeat."""

    def __init__(
        self,
        metrics: WorkerMetrics | None = None,
        *,
        recording: bool | None = None,
        outcomes: OutcomeCounts | None = None,
    ):
        self._metrics = metrics or worker_metrics()
        self._recording = tracing_on() if recording is None else recording
        self._received: OrderedDict[str, SpanContext] = OrderedDict()
        self._engine_cpu_s = 0.0
        self.outcomes = outcomes or OutcomeCounts()  # carried by every heartbeat (ADR 0058)

    def batch_received(self, batch: Batch, record: Any, consumer: Any, partition: Any) -> None:
        """A batch record was read: count it, and record its `receive` span in the batch's trace."""
        metrics = self._metrics
        metrics.lag.observe_record(consumer, record, partition)
        metrics.batches.labels(batch.tier.value).inc()
        if not self._recording:
            return
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
        self._received[batch.batch_id] = span.get_span_context()
        while len(self._received) > RECEIVED_KEPT:
            self._received.popitem(last=False)

    @contextlib.contextmanager
    def run(self, request: QueuedRequest, batch: Batch) -> Iterator[RunTrace]:
        """The request's run, inside its `worker.request` span.

        Inside, the current context is the request's: log lines carry its trace id, and
        the yielded context is what the engine (vLLM) and the final record carry on.
        """
        incoming = context_from(request.trace)
        if not self._recording:
            token = otel_context.attach(incoming)
            try:
                yield RunTrace(incoming, None)
            except Exception:
                self._metrics.requests.labels(request.tier.value, "failed").inc()
                raise
            finally:
                otel_context.detach(token)
            return
        received = self._received.get(batch.batch_id)
        with tracer().start_as_current_span(
            semconv.SPAN_WORKER_REQUEST,
            context=incoming,
            kind=SpanKind.CONSUMER,
            links=[Link(received)] if received is not None and received.is_valid else [],
            attributes={
                semconv.GEN_AI_OPERATION_NAME: "chat",
                semconv.REQUEST_ID: request.request_id,
                semconv.REQUEST_ATTEMPT: request.attempt,
                semconv.TIER: request.tier.value,
                semconv.BATCH_ID: batch.batch_id,
                semconv.BATCH_SIZE: len(batch.requests),
                # Unset (the model's default; max_tokens: the rest of the context): left
                # out, as OpenTelemetry takes no None.
                **sampling_attributes(request),
            },
        ) as span:
            try:
                yield RunTrace(trace.set_span_in_context(span, incoming), span)
            except Exception:
                self._metrics.requests.labels(request.tier.value, "failed").inc()
                span.set_attribute(semconv.RUN_OUTCOME, "failed")
                raise

    def run_ended(self, run: RunTrace, request: QueuedRequest, outcome: str) -> None:
        if run.span is not None:
            run.span.set_attribute(semconv.RUN_OUTCOME, outcome)
        if outcome in ("handed_back", "escalated"):  # escalated: on to a cascade's next model
            self._metrics.requests.labels(request.tier.value, outcome).inc()

    @staticmethod
    def final_headers(run: RunTrace, sent_at: float) -> Headers:
        """Headers of a request's final result record: its trace context and when it was sent."""
        return inject([(SENT_AT_HEADER, repr(sent_at).encode())], run.context)

    def answered(self, run: RunTrace, state: RequestState, final: DoneResult | ErrorResult) -> None:
        """The final record is stored: record the request's worker stages and its metrics."""
        tier = state.request.tier.value
        metrics = self._metrics
        self.outcomes.record(state.request, final)
        if isinstance(final, DoneResult):
            usage = final.usage
            metrics.observe_done(
                tier,
                final.timings,
                final.finish_reason,
                usage.prompt_tokens,
                usage.completion_tokens,
            )
        else:
            metrics.requests.labels(tier, final.code.value).inc()
        if run.span is not None:
            self._record_stages(run, run.span, state, final)

    def observe_capacity(
        self, running: int, total: int, prefix_cache_hit_rate: float | None = None
    ) -> None:
        self._metrics.observe_capacity(running, total)
        if prefix_cache_hit_rate is not None:
            self._metrics.prefix_cache_hit_rate.set(prefix_cache_hit_rate)

    def observe_engine_cpu(self, seconds: float) -> None:
        """The engine's own CPU time so far (cumulative); counted apart from the worker's."""
        if seconds > self._engine_cpu_s:
            self._metrics.engine_cpu.inc(seconds - self._engine_cpu_s)
            self._engine_cpu_s = seconds

    @staticmethod
    def _record_stages(
        run: RunTrace, span: Span, state: RequestState, final: DoneResult | ErrorResult
    ) -> None:
        request = state.request
        done_at = state.done_at if state.done_at is not None else time.time()
        sent = state.final_sent_at if state.final_sent_at is not None else done_at
        common = {semconv.REQUEST_ID: request.request_id, semconv.TIER: request.tier.value}
        record_span(
            semconv.stage_span_name(semconv.STAGE_BATCH_TRANSIT),
            start=state.formed_at,
            end=state.started,
            context=context_from(request.trace),
            attributes={semconv.STAGE: semconv.STAGE_BATCH_TRANSIT, **common},
        )
        first = state.first_token_at if state.first_token_at is not None else done_at
        stages = (
            (semconv.STAGE_PREFILL, state.started, first),
            (semconv.STAGE_DECODE, first, done_at),
            (semconv.STAGE_RESULT_PUBLISH, done_at, sent),
        )
        for stage, start, end in stages:
            record_span(
                semconv.stage_span_name(stage),
                start=start,
                end=end,
                context=run.context,
                attributes={semconv.STAGE: stage, **common},
            )
        if state.variant is not None:
            span.set_attribute(semconv.VARIANT, state.variant)
        if state.model is not None:  # the model that answered (a cascade's: ADR 0059)
            span.set_attribute(semconv.GEN_AI_RESPONSE_MODEL, state.model)
        if isinstance(final, DoneResult):
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
            span.set_attribute(semconv.ERROR_TYPE, final.code.value)
            if final.code is not ErrorCode.cancelled:  # a cancel is the client's wish, no fault
                span.set_status(Status(StatusCode.ERROR))
