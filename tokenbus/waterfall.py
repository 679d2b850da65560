"""A request's trace as a waterfall: spans in parent order, start offsets, and its stages.

Pure: takes span records from any source (JSON-lines files, Jaeger) and returns values and
text. The stage spans (`tokenbus.stage`) tile the request's life, so their sum is checked
against the request's end-to-end time; what they do not cover is printed as `unaccounted`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from shared import semconv
from shared.telemetry import SpanRecord

# Attributes worth a column in the terminal; the rest stay in the JSON output.
KEY_ATTRIBUTES = (
    semconv.TIER,
    semconv.BATCH_ID,
    semconv.BATCH_SIZE,
    semconv.BATCH_REASON,
    semconv.BATCH_FILL_RATIO,
    semconv.MESSAGING_BATCH_MESSAGE_COUNT,
    semconv.MESSAGING_DESTINATION_NAME,
    semconv.WORKER_ID,
    semconv.ADMISSION,
    semconv.RUN_OUTCOME,
    semconv.REQUEST_ATTEMPT,
    semconv.GEN_AI_REQUEST_MAX_TOKENS,
    semconv.GEN_AI_USAGE_INPUT_TOKENS,
    semconv.GEN_AI_USAGE_OUTPUT_TOKENS,
    semconv.GEN_AI_RESPONSE_FINISH_REASONS,
    semconv.ERROR_TYPE,
)
BAR_WIDTH = 32


@dataclass(frozen=True)
class Row:
    span: SpanRecord
    depth: int
    offset_ms: float
    linked: bool  # from another trace (the batch's), linked to this request


@dataclass(frozen=True)
class Waterfall:
    request_id: str
    trace_id: str
    rows: list[Row]
    start_ns: int
    end_ns: int
    stages: dict[str, float]  # stage -> ms, in data-flow order

    @property
    def total_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def stage_total_ms(self) -> float:
        return sum(self.stages.values())

    def as_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "total_ms": round(self.total_ms, 3),
            "stage_total_ms": round(self.stage_total_ms, 3),
            "stages": {k: round(v, 3) for k, v in self.stages.items()},
            "spans": [
                {
                    "service": short_service(r.span.service),
                    "name": r.span.name,
                    "depth": r.depth,
                    "offset_ms": round(r.offset_ms, 3),
                    "duration_ms": round(r.span.duration_ms, 3),
                    "trace_id": r.span.trace_id,
                    "span_id": r.span.span_id,
                    "parent_span_id": r.span.parent_span_id,
                    "linked": r.linked,
                    "attributes": r.span.attributes,
                }
                for r in self.rows
            ],
        }


def short_service(service: str) -> str:
    return service.removeprefix("tokenbus-")


def request_traces(request_id: str, spans: Iterable[SpanRecord]) -> set[str]:
    return {s.trace_id for s in spans if s.attributes.get(semconv.REQUEST_ID) == request_id}


def build(request_id: str, spans: Sequence[SpanRecord]) -> Waterfall | None:
    """The waterfall of one request, or None if no span names it.

    Spans of its trace, plus spans of other traces (the batch it rode) that link to it or
    that it links to.
    """
    traces = request_traces(request_id, spans)
    if not traces:
        return None
    own = [s for s in spans if s.trace_id in traces]
    own_ids = {s.span_id for s in own}
    # The traces of the batch it rode: they link to this trace, or this trace links to them.
    linked_traces = {
        s.trace_id for s in spans if any(link.span_id in own_ids for link in s.links)
    } | {link.trace_id for s in own for link in s.links}
    linked = [s for s in spans if s.trace_id in linked_traces - traces]
    root = _root_span(own)
    start_ns = root.start_ns if root is not None else min(s.start_ns for s in own)
    end_ns = root.end_ns if root is not None else max(s.end_ns for s in own)
    rows = _tree(own, start_ns, linked=False) + _tree(linked, start_ns, linked=True)
    return Waterfall(
        request_id=request_id,
        trace_id=",".join(sorted(traces)),
        rows=rows,
        start_ns=start_ns,
        end_ns=end_ns,
        stages=_stages(own),
    )


def _root_span(spans: Sequence[SpanRecord]) -> SpanRecord | None:
    """The edge's request span, which holds the client-facing end-to-end time."""
    roots = [s for s in spans if s.name == semconv.SPAN_CHAT and s.kind == "SERVER"]
    return min(roots, key=lambda s: s.start_ns) if roots else None


def _stages(spans: Iterable[SpanRecord]) -> dict[str, float]:
    found: dict[str, float] = defaultdict(float)
    for s in spans:
        if s.stage is not None:
            found[s.stage] += s.duration_ms
    ordered: dict[str, float] = {k: found.pop(k) for k in semconv.STAGES if k in found}
    ordered.update(sorted(found.items()))  # stages this version does not know, at the end
    return ordered


def _tree(spans: Sequence[SpanRecord], start_ns: int, *, linked: bool) -> list[Row]:
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        parent = s.parent_span_id if s.parent_span_id in ids else None
        children[parent].append(s)
    rows: list[Row] = []

    def visit(parent: str | None, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: (s.start_ns, -s.end_ns)):
            rows.append(Row(s, depth, (s.start_ns - start_ns) / 1e6, linked))
            visit(s.span_id, depth + 1)

    visit(None, 0)
    return rows


def render(w: Waterfall) -> str:
    """The waterfall as terminal text."""
    span_ns = max(1, w.end_ns - w.start_ns)
    name_width = max([len("span")] + [2 * r.depth + len(r.span.name) for r in w.rows])
    header = (
        f"{'service':<10} {'span':<{name_width}} {'start ms':>9} {'dur ms':>9}  "
        f"{'':<{BAR_WIDTH}}  attributes"
    )
    lines = [
        f"request {w.request_id}  trace {w.trace_id}  {w.total_ms:.1f} ms end to end",
        header,
        "-" * len(header),
    ]
    shown_linked = False
    for r in w.rows:
        if r.linked and not shown_linked:
            lines.append("linked (the batch this request rode):")
            shown_linked = True
        s = r.span
        name = "  " * r.depth + s.name
        lines.append(
            f"{short_service(s.service):<10} {name:<{name_width}} {r.offset_ms:>9.3f} "
            f"{s.duration_ms:>9.3f}  {_bar(s, w.start_ns, span_ns)}  {_attributes(s)}"
        )
    lines.append("")
    lines.append("stages (they tile the request's life):")
    for stage, ms in w.stages.items():
        share = 100.0 * ms / w.total_ms if w.total_ms > 0 else 0.0
        lines.append(f"  {stage:<15} {ms:>10.3f} ms  {share:5.1f} %")
    unaccounted = w.total_ms - w.stage_total_ms
    lines.append(
        f"  {'sum':<15} {w.stage_total_ms:>10.3f} ms of {w.total_ms:.3f} ms"
        f"  (unaccounted {unaccounted:.3f} ms)"
    )
    return "\n".join(lines)


def _bar(s: SpanRecord, start_ns: int, span_ns: int) -> str:
    first = max(0, min(BAR_WIDTH - 1, int((s.start_ns - start_ns) * BAR_WIDTH / span_ns)))
    last = max(first + 1, min(BAR_WIDTH, round((s.end_ns - start_ns) * BAR_WIDTH / span_ns)))
    return " " * first + "█" * (last - first) + " " * (BAR_WIDTH - last)


def _attributes(s: SpanRecord) -> str:
    parts = []
    if s.stage is not None:
        parts.append(f"stage={s.stage}")
    for key in KEY_ATTRIBUTES:
        if key in s.attributes:
            value = s.attributes[key]
            if isinstance(value, list):
                value = ",".join(str(v) for v in value)
            parts.append(f"{key.removeprefix('tokenbus.')}={value}")
    if s.status == "ERROR":
        parts.append("status=ERROR")
    return " ".join(parts)


@dataclass(frozen=True)
class RequestSummary:
    request_id: str
    trace_id: str
    start_ns: int
    total_ms: float
    tier: str | None
    slowest_stage: str | None


def summaries(spans: Sequence[SpanRecord]) -> list[RequestSummary]:
    """One summary per request id found in the spans."""
    by_trace: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    out: list[RequestSummary] = []
    for trace_id, members in by_trace.items():
        rids = {s.attributes.get(semconv.REQUEST_ID) for s in members} - {None}
        if len(rids) != 1:
            continue  # a batch's trace, or a trace of no request
        rid = str(rids.pop())
        root = _root_span(members)
        start = root.start_ns if root else min(s.start_ns for s in members)
        end = root.end_ns if root else max(s.end_ns for s in members)
        stages = _stages(members)
        tiers = {s.attributes.get(semconv.TIER) for s in members} - {None}
        out.append(
            RequestSummary(
                request_id=rid,
                trace_id=trace_id,
                start_ns=start,
                total_ms=(end - start) / 1e6,
                tier=str(tiers.pop()) if tiers else None,
                slowest_stage=max(stages, key=lambda k: stages[k]) if stages else None,
            )
        )
    return out


def slowest(spans: Sequence[SpanRecord], n: int) -> list[RequestSummary]:
    return sorted(summaries(spans), key=lambda r: r.total_ms, reverse=True)[:n]


def render_slowest(rows: Sequence[RequestSummary]) -> str:
    header = f"{'total ms':>10}  {'tier':<12} {'slowest stage':<15} {'request_id':<34} trace_id"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.total_ms:>10.1f}  {r.tier or '-':<12} {r.slowest_stage or '-':<15} "
            f"{r.request_id:<34} {r.trace_id}"
        )
    return "\n".join(lines)
