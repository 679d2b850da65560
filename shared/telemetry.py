"""Tracing setup per service, W3C trace context on Kafka headers, spans as JSON lines.

Where spans go, decided once per process by `setup_tracing`:
- `OTEL_EXPORTER_OTLP_ENDPOINT` set: OTLP over HTTP (the optional extra `otlp`), e.g. Jaeger;
- else `TOKENBUS_TRACE_DIR` set: one JSON-lines file per process in that directory, which
  `tokenbus trace` reads (`tokenbus up` sets it to `.tokenbus/traces`);
- else nowhere: no SDK is installed, spans are no-ops, but a trace context that arrives in
  a record's headers is still passed on, so an external producer's trace is never cut.

Which traces are kept, where spans go somewhere: `TOKENBUS_TRACE_SAMPLE_RATIO` of the traces
that start in tokenbus (head sampling on the trace id), and every span of a trace whose
parent was kept (parent-based), so a kept trace is whole across services and one dropped at
the edge is dropped everywhere. A dropped span is a non-recording one: nothing is exported.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal

import structlog
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Link, SpanContext, SpanKind, Tracer
from opentelemetry.util.types import Attributes
from pydantic import AliasChoices, BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared import semconv

Headers = list[tuple[str, bytes]]
Carrier = dict[str, str]

TRACER_NAME = "tokenbus"
# On a request's final result record: when the worker wrote it (Unix seconds, as text). The
# worker's `result_publish` stage ends and the edge's `deliver` stage begins at this instant,
# finer than the record's millisecond timestamp.
SENT_AT_HEADER = "tokenbus-sent-at"
DEFAULT_TRACE_DIR = Path(".tokenbus/traces")

log = structlog.get_logger()


class TelemetrySettings(BaseSettings):
    """Where spans and metrics go; read from the environment like every tokenbus setting."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_", extra="ignore")

    trace_dir: Path | None = Field(
        default=None,
        description="Write spans as JSON lines here (one file per process); unset = don't.",
    )
    trace_flush_ms: int = Field(
        default=500,
        ge=1,
        description="Longest a finished span waits before it is written or exported.",
    )
    trace_sample_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Share of new traces kept (head sampling by trace id); a trace's later "
        "spans follow its first, so a kept trace is whole. 1 = all, 0 = none.",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description=(
            "Port of a service's /metrics, /healthz and /readyz (the edge also answers"
            " /healthz and /readyz on its HTTP port, never /metrics). Unset: 9100 edge, 9101"
            " ingest, 9102 scheduler, 9103 worker; 0 = off."
        ),
    )
    metrics_host: str = Field(
        default="127.0.0.1", description="Bind address of /metrics, /healthz and /readyz."
    )
    otlp_endpoint: str | None = Field(
        default=None,
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_ENDPOINT"),
        description="Standard OTel variable: export spans over OTLP/HTTP to this collector.",
    )
    sdk_disabled: bool = Field(
        default=False,
        validation_alias=AliasChoices("OTEL_SDK_DISABLED"),
        description="Standard OTel variable: no tracing at all, whatever else is set.",
    )


# --- span records: the JSON-lines format, also what `tokenbus trace` reads --------------


class LinkRecord(BaseModel):
    trace_id: str
    span_id: str
    attributes: dict[str, Any] = Field(default_factory=dict)


class SpanRecord(BaseModel):
    """One finished span as written to a JSON-lines file (ids in lowercase hex, times in ns)."""

    trace_id: str
    span_id: str
    parent_span_id: str | None = None
    name: str
    kind: str = "INTERNAL"
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = Field(default_factory=dict)
    links: list[LinkRecord] = Field(default_factory=list)
    status: Literal["UNSET", "OK", "ERROR"] = "UNSET"

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def stage(self) -> str | None:
        value = self.attributes.get(semconv.STAGE)
        return value if isinstance(value, str) else None


def hex_trace_id(trace_id: int) -> str:
    return format(trace_id, "032x")


def hex_span_id(span_id: int) -> str:
    return format(span_id, "016x")


def span_record(span: ReadableSpan) -> SpanRecord:
    ctx = span.get_span_context()
    assert ctx is not None
    service = span.resource.attributes.get(semconv.SERVICE_NAME, "unknown")
    return SpanRecord(
        trace_id=hex_trace_id(ctx.trace_id),
        span_id=hex_span_id(ctx.span_id),
        parent_span_id=hex_span_id(span.parent.span_id) if span.parent is not None else None,
        name=span.name,
        kind=span.kind.name,
        service=str(service),
        start_ns=span.start_time or 0,
        end_ns=span.end_time or span.start_time or 0,
        attributes=_plain(span.attributes),
        links=[
            LinkRecord(
                trace_id=hex_trace_id(link.context.trace_id),
                span_id=hex_span_id(link.context.span_id),
                attributes=_plain(link.attributes),
            )
            for link in span.links
        ],
        status=span.status.status_code.name,
    )


def _plain(attributes: Attributes) -> dict[str, Any]:
    # OTel keeps sequences as tuples; JSON wants lists.
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line to `{directory}/{service}-{pid}.jsonl`.

    One file per process, so processes never interleave partial lines; the batch processor
    calls `export` from one thread, the lock only guards against a late `shutdown`.
    """

    def __init__(self, directory: Path, service: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{service}-{os.getpid()}.jsonl"
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(span_record(s).model_dump_json() + "\n" for s in spans)
        with self._lock:
            if self._file is None:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_span_file(path: Path) -> Iterable[SpanRecord]:
    """Every span of one JSON-lines file; a torn last line (a killed writer) is skipped."""
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                yield SpanRecord.model_validate_json(line)


# --- setup -------------------------------------------------------------------------------


def service_resource(service: str) -> Resource:
    return Resource.create(
        {semconv.SERVICE_NAME: f"tokenbus-{service}", "service.namespace": "tokenbus"}
    )


def make_exporter(service: str, settings: TelemetrySettings) -> SpanExporter | None:
    """The exporter the settings ask for, or None when spans go nowhere."""
    if settings.sdk_disabled:
        return None
    if settings.otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            # Telemetry must never take serving down: say so loudly and serve untraced.
            log.error(
                "telemetry.otlp_unavailable",
                endpoint=settings.otlp_endpoint,
                hint="pip install 'tokenbus[otlp]'",
            )
            return None
        # The exporter reads OTEL_EXPORTER_OTLP_ENDPOINT itself and appends /v1/traces.
        exporter: SpanExporter = OTLPSpanExporter()
        return exporter
    if settings.trace_dir is not None:
        return JsonLinesSpanExporter(settings.trace_dir, service)
    return None


def setup_tracing(
    service: str,
    settings: TelemetrySettings | None = None,
    exporter: SpanExporter | None = None,
) -> TracerProvider | None:
    """Install this process's tracer provider; None (no-op tracing) if spans go nowhere.

    `exporter` overrides the settings (tests pass an in-memory one).
    """
    settings = settings or TelemetrySettings()
    exporter = exporter or make_exporter(service, settings)
    if exporter is None:
        return None
    provider = TracerProvider(
        resource=service_resource(service), sampler=head_sampler(settings.trace_sample_ratio)
    )
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=settings.trace_flush_ms)
    )
    trace.set_tracer_provider(provider)
    log.info(
        "telemetry.tracing",
        service=service,
        exporter=type(exporter).__name__,
        sample_ratio=settings.trace_sample_ratio,
    )
    return provider


def head_sampler(ratio: float) -> Sampler:
    """Keep `ratio` of new traces by trace id; a span with a parent follows the parent."""
    return ParentBased(root=TraceIdRatioBased(ratio))


def tracer() -> Tracer:
    """The tokenbus tracer of the installed provider (a no-op one if none is installed)."""
    return trace.get_tracer(TRACER_NAME)


# --- W3C trace context on Kafka headers and in records -----------------------------------


def inject(headers: Headers | None = None, context: Context | None = None) -> Headers:
    """Add the W3C trace context (`traceparent`, `tracestate`) of `context` to Kafka headers.

    Existing trace headers are replaced; returns the list (a new one if None was given).
    """
    out: Headers = headers if headers is not None else []
    found = carrier(context)
    out[:] = [(k, v) for k, v in out if k not in found]
    out.extend((k, v.encode()) for k, v in found.items())
    return out


def extract(headers: Iterable[tuple[str, bytes]] | Mapping[str, str] | None) -> Context:
    """The trace context carried by Kafka headers (aiokafka's list or a str mapping)."""
    if headers is None:
        return Context()
    if isinstance(headers, Mapping):
        return context_from(headers)
    found: Carrier = {}
    for name, value in headers:
        if isinstance(value, bytes | bytearray):
            found[name.lower()] = bytes(value).decode("latin-1")
    return context_from(found)


def carrier(context: Context | None = None) -> Carrier:
    """The W3C headers of `context` (default: the current one), as a plain dict."""
    out: Carrier = {}
    propagate.inject(out, context=context)
    return out


def context_from(found: Mapping[str, str]) -> Context:
    return propagate.extract({k.lower(): v for k, v in found.items()})


def sent_at(headers: Iterable[tuple[str, bytes]] | None, fallback: float) -> float:
    """The `SENT_AT_HEADER` instant of a record, or `fallback` (its Kafka timestamp)."""
    for name, value in headers or ():
        if name == SENT_AT_HEADER:
            try:
                return float(value)
            except ValueError:
                break
    return fallback


def has_trace(context: Context) -> bool:
    return trace.get_current_span(context).get_span_context().is_valid


def span_context_of(context: Context) -> SpanContext:
    return trace.get_current_span(context).get_span_context()


def dropped(context: Context) -> bool:
    """Whether `context` holds a trace that head sampling dropped (a valid parent whose
    sampled flag is off): parent-based sampling records nothing under it."""
    parent = trace.get_current_span(context).get_span_context()
    return parent.is_valid and not parent.trace_flags.sampled


def ns(seconds: float) -> int:
    """Unix seconds (time.time()) to the nanoseconds OTel wants."""
    return int(seconds * 1e9)


def record_span(
    name: str,
    *,
    start: float,
    end: float,
    context: Context | None,
    attributes: Attributes = None,
    kind: SpanKind = SpanKind.INTERNAL,
    links: Sequence[Link] = (),
    tracer_: Tracer | None = None,
) -> Context:
    """Record a span whose times are already known; return a context with it as parent.

    Stage spans are recorded after the fact from timestamps carried in the records, so that
    consecutive stages share their boundary instant exactly. Under a parent that head
    sampling dropped nothing is recorded, so no span is made at all: the parent's context
    (and with it the decision) passes on unchanged, at the cost of one lookup.
    """
    if context is not None and dropped(context):
        return context
    span = (tracer_ or tracer()).start_span(
        name, context=context, kind=kind, attributes=attributes, links=links, start_time=ns(start)
    )
    span.end(end_time=ns(max(start, end)))
    return trace.set_span_in_context(span, context)


def add_trace_ids(
    logger: object, method: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """structlog processor: the current trace and span id on every line logged inside one."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", hex_trace_id(ctx.trace_id))
        event_dict.setdefault("span_id", hex_span_id(ctx.span_id))
    return event_dict


def start_telemetry(service: str) -> TelemetrySettings:
    """A service's tracer provider at start-up; the settings also say where `/metrics` goes
    (`shared.health.with_health`)."""
    settings = TelemetrySettings()
    setup_tracing(service, settings)
    return settings
