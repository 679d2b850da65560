"""CPU cost of one request's spans, with tracing off, on, and head-sampled.

A request leaves five spans across the services (edge, ingest, scheduler, worker, deliver),
each recorded after the fact from a parent carried on Kafka headers: `extract` the parent,
`record_span`, `inject` the child. This times that chain in one process, per request, for

- `off`: no SDK installed (no exporter configured: the default);
- `on`: every trace kept, spans handed to a batch processor (an exporter that drops them,
  so the export's I/O is not what is timed);
- `sampled R`: `TOKENBUS_TRACE_SAMPLE_RATIO=R`, parent-based: the edge decides, the rest
  follow its decision from the header.

    python -m bench.span_cost            # prints µs per request for each mode
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NoOpTracerProvider, Tracer

from shared.telemetry import extract, head_sampler, inject, record_span, service_resource

STAGES = ("ingest", "scheduler", "worker", "deliver")


class DroppingExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def tracer_for(mode: str, ratio: float) -> Tracer:
    if mode == "off":
        return NoOpTracerProvider().get_tracer("tokenbus")
    provider = TracerProvider(resource=service_resource("bench"), sampler=head_sampler(ratio))
    provider.add_span_processor(BatchSpanProcessor(DroppingExporter()))
    return provider.get_tracer("tokenbus")


def one_request(tracer: Tracer) -> Callable[[], None]:
    attributes = {"tokenbus.request_id": "r-123", "tokenbus.tier": "interactive"}

    def run() -> None:
        context = record_span("edge", start=1.0, end=1.001, context=None, tracer_=tracer)
        headers = inject(context=context)
        for stage in STAGES:
            parent = extract(headers)
            child = record_span(
                stage, start=1.0, end=1.001, context=parent, attributes=attributes, tracer_=tracer
            )
            headers = inject(context=child)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.span_cost", description=__doc__)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--ratio", type=float, default=0.01, help="the sampled mode's ratio")
    args = parser.parse_args(argv)
    modes = (("off", 1.0), ("on", 1.0), (f"sampled {args.ratio:g}", args.ratio))
    print(f"{'mode':<14} {'µs/request (5 spans)':>22}")
    for name, ratio in modes:
        run = one_request(tracer_for(name.split()[0], ratio))
        best = min(timeit.repeat(run, number=args.requests, repeat=5))
        print(f"{name:<14} {best / args.requests * 1e6:22.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
