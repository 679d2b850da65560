"""Where `tokenbus trace` finds spans: the JSON-lines files of a run, or a Jaeger query API."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Iterator
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
    """Jaeger's HTTP query API (`/api/traces`, served by Jaeger v2 on the UI port 16686)."""

    def __init__(self, url: str, lookback: str = "2h", timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.lookback = lookback
        self.timeout_s = timeout_s

    def _get(self, path: str, **params: str) -> dict[str, Any]:
        query = urllib.parse.urlencode(params)
        url = f"{self.url}{path}" + (f"?{query}" if query else "")
        # No proxy: Jaeger is the operator's own, usually on localhost.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=self.timeout_s) as response:
            body: dict[str, Any] = json.load(response)
        return body

    def request_spans(self, request_id: str) -> list[SpanRecord]:
        tags = json.dumps({semconv.REQUEST_ID: request_id})
        for service in SERVICES:
            found = self._get(
                "/api/traces",
                service=f"tokenbus-{service}",
                tags=tags,
                lookback=self.lookback,
                limit="20",
            )
            spans = jaeger_spans(found)
            if spans:
                break
        else:
            return []
        have = {s.trace_id for s in spans}
        for trace_id in sorted({link.trace_id for s in spans for link in s.links} - have):
            spans += jaeger_spans(self._get(f"/api/traces/{trace_id}"))
        return spans

    def recent_spans(self, limit: int) -> list[SpanRecord]:
        found = self._get(
            "/api/traces",
            service="tokenbus-edge",
            operation=semconv.SPAN_CHAT,
            lookback=self.lookback,
            limit=str(limit),
        )
        return jaeger_spans(found)


def jaeger_spans(body: dict[str, Any]) -> list[SpanRecord]:
    """Span records from a Jaeger query API answer (`{"data": [trace, ...]}`)."""
    out: list[SpanRecord] = []
    for trace in body.get("data") or []:
        processes = trace.get("processes", {})
        for span in trace.get("spans", []):
            tags = {t["key"]: t.get("value") for t in span.get("tags", [])}
            parent = None
            links: list[LinkRecord] = []
            for ref in span.get("references", []):
                if ref.get("refType") == "CHILD_OF" and ref.get("traceID") == span["traceID"]:
                    parent = _pad(ref["spanID"], 16)
                else:
                    links.append(
                        LinkRecord(
                            trace_id=_pad(ref["traceID"], 32), span_id=_pad(ref["spanID"], 16)
                        )
                    )
            start_ns = int(span["startTime"]) * 1000
            status = (
                "ERROR" if tags.get("otel.status_code") == "ERROR" or tags.get("error") else "UNSET"
            )
            out.append(
                SpanRecord(
                    trace_id=_pad(span["traceID"], 32),
                    span_id=_pad(span["spanID"], 16),
                    parent_span_id=parent,
                    name=span["operationName"],
                    kind=str(tags.pop("span.kind", "internal")).upper(),
                    service=processes.get(span.get("processID"), {}).get("serviceName", "unknown"),
                    start_ns=start_ns,
                    end_ns=start_ns + int(span.get("duration", 0)) * 1000,
                    attributes=tags,
                    links=links,
                    status=status,
                )
            )
    return out


def _pad(hex_id: str, width: int) -> str:
    # Jaeger drops leading zeros of ids.
    return hex_id.lower().rjust(width, "0")
