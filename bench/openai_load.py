"""Open-loop load over the OpenAI-compatible API: the same planned arrivals, sent as SSE requests.

Each planned `chat.request` becomes a streaming `/v1/chat/completions` (messages) or
`/v1/completions` (prompt) request with `stream_options.include_usage`, so the traces are
the WebSocket generator's (`loadgen.py`) and the same statistics apply to both paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from bench.loadgen import CONNECTION_CLOSED, LoadConfig, LoadResult, RequestTrace
from bench.workload import PlannedRequest

PROGRESS_EVERY_S = 0.5
# HTTP status -> the protocol's error code, so both paths count errors alike.
STATUS_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    429: "rate_limited",
    503: "overloaded",
    504: "deadline_exceeded",
}
# Fields of a planned `chat.request` frame that the OpenAI body carries under the same name.
SAME_NAME = ("max_tokens", "temperature", "top_p", "stop", "priority", "deadline_ms")


def http_target(url: str) -> tuple[str, str | None]:
    """`ws://[tenant:KEY@]host:port/v1/chat` (or an http URL) -> (`http://host:port`, KEY)."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    netloc = parts.netloc.rpartition("@")[2]  # credentials go in the header
    return urlunsplit((scheme, netloc, "", "", "")), parts.password or parts.username


def openai_request(frame: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The endpoint path and the body for one planned `chat.request` frame."""
    body: dict[str, Any] = {k: frame[k] for k in SAME_NAME if frame.get(k) is not None}
    body.update(stream=True, stream_options={"include_usage": True})
    if frame.get("messages") is not None:
        return "/v1/chat/completions", {**body, "messages": frame["messages"]}
    return "/v1/completions", {**body, "prompt": frame["prompt"]}


class _Counts:
    def __init__(self, total: int) -> None:
        self.total = total
        self.sent = self.finished = self.errors = self.in_flight = self.shed = 0
        self.last_answer = 0.0
        self.all_answered = asyncio.Event()

    def answered(self, trace: RequestTrace, now: float, error: str | None = None) -> None:
        if error is not None:
            trace.error_code = error
            self.errors += 1
        else:
            trace.done_at = now
        self.in_flight -= 1
        self.finished += 1
        self.last_answer = now
        if self.in_flight == 0 and self.sent + self.shed == self.total:
            self.all_answered.set()


async def run_openai_load(
    config: LoadConfig,
    planned: list[PlannedRequest],
    progress: Callable[[str], None] | None = None,
) -> LoadResult:
    """Send every planned request at its time over HTTP; return once all are answered."""
    import httpx  # the `bench` extra; only this path needs it

    traces = [RequestTrace(p) for p in planned]
    counts = _Counts(len(traces))
    base, url_key = http_target(config.url)
    key = config.api_key or url_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=config.concurrency_cap, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=base, headers=headers, limits=limits, timeout=httpx.Timeout(60.0, read=None)
    ) as client:
        tasks: list[asyncio.Task[None]] = []
        ticker = asyncio.create_task(_progress(config, counts, progress)) if progress else None
        started_at, started_wall = time.monotonic(), time.time()
        for trace in traces:
            due = started_at + trace.planned.at_s
            if (delay := due - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            now = time.monotonic()
            trace.lag_s = max(0.0, now - due)
            if counts.in_flight >= config.concurrency_cap:
                trace.shed = True
                counts.shed += 1
                continue
            trace.sent_at = now
            trace.sent_wall = time.time()
            counts.in_flight += 1
            counts.sent += 1
            tasks.append(asyncio.create_task(_one(client, trace, counts)))
        if counts.in_flight == 0:
            counts.all_answered.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(counts.all_answered.wait(), config.drain_s)
        ended_at = counts.last_answer if counts.all_answered.is_set() else time.monotonic()
        for task in tasks:
            task.cancel()  # the edge cancels them after its disconnect grace
        await asyncio.gather(*tasks, return_exceptions=True)
        if ticker is not None:
            ticker.cancel()
            if progress is not None:
                progress(_status(config, counts, started_at, final=True))
    return LoadResult(traces, started_at, started_wall, max(ended_at, started_at))


async def _one(client: Any, trace: RequestTrace, counts: _Counts) -> None:
    import httpx

    path, body = openai_request(trace.planned.body)
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                code = STATUS_CODES.get(response.status_code, f"http_{response.status_code}")
                counts.answered(trace, time.monotonic(), code)
                return
            trace.accepted_at = time.monotonic()
            trace.request_id = response.headers.get("x-request-id")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                now = time.monotonic()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    counts.answered(trace, now, str(chunk["error"].get("code") or "internal"))
                    return
                if chunk.get("usage"):
                    trace.completion_tokens = int(chunk["usage"]["completion_tokens"])
                for choice in chunk.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        trace.delta_at.append(now)
        counts.answered(trace, time.monotonic())
    except httpx.HTTPError:
        counts.answered(trace, time.monotonic(), CONNECTION_CLOSED)


async def _progress(
    config: LoadConfig, counts: _Counts, show: Callable[[str], None] | None
) -> None:
    zero = time.monotonic()
    while show is not None:
        await asyncio.sleep(PROGRESS_EVERY_S)
        show(_status(config, counts, zero))


def _status(config: LoadConfig, counts: _Counts, zero: float, final: bool = False) -> str:
    label = f"[{config.label}] " if config.label else ""
    return (
        f"{label}t={time.monotonic() - zero:5.1f}s sent={counts.sent}/{counts.total} "
        f"done={counts.finished - counts.errors} err={counts.errors} "
        f"in_flight={counts.in_flight} shed={counts.shed}" + (" ✓" if final else "")
    )
