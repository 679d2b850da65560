"""Where `tokenbus trace` finds spans: the JSON-lines files of a run, or Jaeger's query API v3."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from shared import semconv
from shared.telemetry import LinkRecord, SpanRecord, read_span_file

SERVICES = ("edge", "ingest", "scheduler", "worker")


class SpanSource(Protocol):
    def request_spans(self, request_id: str) -> list[SpanRecord]:
        """Every span of the request's trace, and of the traces linked to it."""
        ...

    def recent_spans(self, limit: int) -> list[SpanRecord]:
        """Spans of recent requests, for `--slowest`."""
        ...


class JsonLinesSource:
    """The `*.jsonl` span files under one directory (one file per service process)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _lines(self) -> Iterator[str]:
        for path in sorted(self.directory.glob("*.jsonl")):
            with path.open(encoding="utf-8") as f:
                for line in f:
                    if line.endswith("\n"):  # a torn last line of a killed writer is skipped
                        yield line

    def request_spans(self, request_id: str) -> list[SpanRecord]:
        # Two passes over the text; only lines that can match are parsed.
        traces = {
            s.trace_id
            for s in (SpanRecord.model_validate_json(x) for x in self._lines() if request_id in x)
            if s.attributes.get(semconv.REQUEST_ID) == request_id
        }
        if not traces:
            return []
        own = [
            s
            for s in (
                SpanRecord.model_validate_json(x)
                for x in self._lines()
                if any(t in x for t in traces)
            )
        ]
        # Linked traces (the batch): spans that link to this trace or that it links to.
        linked_traces = (
            {s.trace_id for s in own} | {link.trace_id for s in own for link in s.links}
        ) - traces
        if linked_traces:
            own += [
                SpanRecord.model_validate_json(x)
                for x in self._lines()
                if any(t in x for t in linked_traces)
            ]
        unique = {(s.trace_id, s.span_id): s for s in own}
        wanted = traces | linked_traces
        return [s for s in unique.values() if s.trace_id in wanted or _links_to(s, traces)]

    def recent_spans(self, limit: int) -> list[SpanRecord]:
        spans: list[SpanRecord] = []
        for path in sorted(self.directory.glob("*.jsonl")):
            spans.extend(read_span_file(path))
        return spans


def _links_to(span: SpanRecord, traces: set[str]) -> bool:
    return any(link.trace_id in traces for link in span.links)


class JaegerSource:
    """Jaeger's query API v3 (`/api/v3/traces`, OTLP JSON; Jaeger v2 serves it on the UI
    port, 16686 by default).

    The v3 HTTP search takes no attribute filter, so a request is found among the edge's
    traces of the last `lookback`, newest `search_depth` of them; its trace comes whole,
    and the traces it links to (the batch it rode) are fetched by id.
    """

    def __init__(
        self,
        url: str,
        lookback: timedelta = timedelta(hours=2),
        timeout_s: float = 10.0,
        search_depth: int = 1000,
    ) -> None:
        self.url = url.rstrip("/")
        self.lookback = lookback
        self.timeout_s = timeout_s
        self.search_depth = search_depth

    def _get(self, path: str, **params: str) -> dict[str, Any]:
        query = urllib.parse.urlencode(params)
        url = f"{self.url}{path}" + (f"?{query}" if query else "")
        # No proxy: Jaeger is the operator's own, usually on localhost.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(url, timeout=self.timeout_s) as response:
                body: dict[str, Any] = json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # v3's answer to a search or trace id with nothing in it
                return {}
            raise
        return body

    def _find(self, limit: int, operation: str | None = None) -> list[SpanRecord]:
        now = datetime.now(UTC)
        params = {
            "query.service_name": "tokenbus-edge",
            "query.start_time_min": (now - self.lookback).isoformat(),
            "query.start_time_max": (now + timedelta(minutes=1)).isoformat(),
            "query.num_traces": str(limit),
        }
        if operation is not None:
            params["query.operation_name"] = operation
        return otlp_spans(self._get("/api/v3/traces", **params))

    def request_spans(self, request_id: str) -> list[SpanRecord]:
        found = self._find(self.search_depth)
        traces = {s.trace_id for s in found if s.attributes.get(semconv.REQUEST_ID) == request_id}
        spans = [s for s in found if s.trace_id in traces]
        for trace_id in sorted({link.trace_id for s in spans for link in s.links} - traces):
            spans += otlp_spans(self._get(f"/api/v3/traces/{trace_id}"))
        return spans

    def recent_spans(self, limit: int) -> list[SpanRecord]:
        return self._find(limit, operation=semconv.SPAN_CHAT)


def otlp_spans(body: dict[str, Any]) -> list[SpanRecord]:
    """Span records from a Jaeger API v3 answer: `{"result": TracesData}` in OTLP JSON."""
    out: list[SpanRecord] = []
    for resource_spans in (body.get("result") or {}).get("resourceSpans") or []:
        resource = _otlp_attributes((resource_spans.get("resource") or {}).get("attributes"))
        service = str(resource.get(semconv.SERVICE_NAME, "unknown"))
        for scope_spans in resource_spans.get("scopeSpans") or []:
            for span in scope_spans.get("spans") or []:
                parent = span.get("parentSpanId")
                status = str((span.get("status") or {}).get("code", ""))
                out.append(
                    SpanRecord(
                        trace_id=_otlp_id(span["traceId"], 32),
                        span_id=_otlp_id(span["spanId"], 16),
                        parent_span_id=_otlp_id(parent, 16) if parent else None,
                        name=span["name"],
                        kind=_otlp_kind(span.get("kind")),
                        service=service,
                        start_ns=int(span.get("startTimeUnixNano", 0)),
                        end_ns=int(span.get("endTimeUnixNano", 0)),
                        attributes=_otlp_attributes(span.get("attributes")),
                        links=[
                            LinkRecord(
                                trace_id=_otlp_id(link["traceId"], 32),
                                span_id=_otlp_id(link["spanId"], 16),
                                attributes=_otlp_attributes(link.get("attributes")),
                            )
                            for link in span.get("links") or []
                        ],
                        status="ERROR" if status in ("STATUS_CODE_ERROR", "2") else "UNSET",
                    )
                )
    return out


_KINDS = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")


def _otlp_kind(kind: object) -> str:
    """`SPAN_KIND_SERVER` (protobuf JSON) or 2 (its number) -> `SERVER`."""
    if isinstance(kind, int) and 0 <= kind < len(_KINDS):
        name = _KINDS[kind]
    else:
        name = str(kind or "INTERNAL").removeprefix("SPAN_KIND_")
    return "INTERNAL" if name == "UNSPECIFIED" else name


def _otlp_id(value: str, width: int) -> str:
    """Ids in hex (OTLP JSON) or base64 (protobuf JSON of bytes), as lowercase hex."""
    if len(value) == width and all(c in "0123456789abcdefABCDEF" for c in value):
        return value.lower()
    return base64.b64decode(value).hex().rjust(width, "0")


def _otlp_attributes(attributes: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {a["key"]: _otlp_value(a.get("value") or {}) for a in attributes or []}


def _otlp_value(value: dict[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])  # a string in protobuf JSON
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_otlp_value(v) for v in value["arrayValue"].get("values") or []]
    return None
