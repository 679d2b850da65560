"""Chaos load over the OpenAI API, through the official `openai` SDK (issue 38, item 5).

Two requesters, as applications use the API:

- **streaming** (`openai-stream`): `chat.completions` with `stream=True`, event ids asked
  (`X-Tokenbus-Event-Ids: 1`). When its connection drops (an edge killed), it sends the
  same request to the other edge with `Last-Event-ID` and `X-Tokenbus-Resume-Token`, as the
  README says, and the stream goes on after the last event it read. It keeps every event it
  read, in order: `tests/chaos/checker.py` judges them (one answer, nothing twice, no gap,
  the engine's text; an `error` event is counted apart: a worker or engine lost must cause
  none).
- **non-streaming** (`openai`): one whole answer per call. A call whose edge went away is
  sent again to the other edge, as the SDK's own retry would (a new request: the first one's
  answer is never read).

The SDK makes each call, raises its status errors and parses each chunk
(`ChatCompletionChunk`); the requester reads the SSE lines itself only to keep each event's
`id:`, which the SDK does not expose.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx2  # the SDK's HTTP client (openai 3): a stream cut mid-read raises its errors
import openai
from openai.types.chat import ChatCompletionChunk

from tests.chaos.availability import Sample
from tests.chaos.checker import History
from tests.chaos.load import Frame, Planned

MODEL = "sim-8b"  # the workers' default `worker_model`
EVENT_IDS = {"X-Tokenbus-Event-Ids": "1"}
REFUSALS = (429, 503)  # before a request is on the bus: not accepted
# A resume refused `overloaded` is tried again after 0.5 s, doubling to 4 s (as WsUser does).
RESUME_RETRY_S = (0.5, 4.0)
MOVE_PAUSE_S = 0.2  # before the other edge is tried: the one that went is down


def sim_prompt(planned: Planned) -> str:
    """What the sim engine is given for the request's one user message (`prompt_text`)."""
    return f"user: {planned.prompt}"


@dataclass
class OpenAiRequest:
    planned: Planned
    index: int
    request_id: str | None = None
    resume_token: str | None = None
    last_id: str | None = None  # the last event id read: where a resume goes on
    events: list[Frame] = field(default_factory=list)
    refused: str | None = None  # 429/503 before it was accepted: never acknowledged
    final: bool = False
    resumes: int = 0
    resent: int = 0  # sent again as a new request after its edge went (non-streaming)
    error_events_at: list[float] = field(default_factory=list)
    # time.monotonic(): sent, accepted (the stream's 200; the whole answer's arrival for a
    # non-streaming call), the first text, the final.
    sent_at: float | None = None
    accepted_at: float | None = None
    first_token_at: float | None = None
    final_at: float | None = None

    @property
    def settled(self) -> bool:
        return self.final or self.refused is not None

    @property
    def outcome(self) -> str | None:
        """`done`, `sse error`, `http <status>`, or None: no final yet."""
        if not self.final:
            return None
        if self.error_events_at:
            return "sse error"
        last = self.events[-1]
        return f"http {last['status']}" if "status" in last else "done"

    def take(self, event_id: str | None, data: str) -> None:
        """File one SSE event of the stream, in order."""
        now = time.monotonic()
        if event_id is not None:
            self.last_id = event_id
        body: Any = data if data == "[DONE]" else json.loads(data)
        self.events.append({"id": event_id, "data": body})
        if body == "[DONE]":
            self.final, self.final_at = True, now
        elif "error" in body:
            self.error_events_at.append(now)
        elif self.first_token_at is None:
            chunk = ChatCompletionChunk.model_validate(body)  # the SDK's own type
            if chunk.choices and chunk.choices[0].delta.content:
                self.first_token_at = now

    def finish(self, event: Frame) -> None:
        self.events.append(event)
        self.final, self.final_at = True, time.monotonic()


class OpenAiRequester:
    """Requests over the OpenAI API of two edges, one task each (open loop)."""

    def __init__(
        self, channel: str, base_urls: list[str], api_key: str, *, retry_refused: bool = False
    ) -> None:
        if channel not in ("openai-stream", "openai"):
            raise ValueError(f"not an OpenAI channel: {channel!r}")
        self.channel = channel
        self.api_key = api_key
        self.clients = [self._client(url) for url in base_urls]
        self._retired: list[openai.AsyncOpenAI] = []
        # A 429 or 503 before acceptance (and a whole answer's 503 `edge_restarting`) is sent
        # again to the next edge after its retry hint, as the SDK's retries behind a load
        # balancer would (a draining edge refuses: tests/upgrade/); else it is `refused`.
        self.retry_refused = retry_refused
        self.refusals_retried = 0
        self.requests: list[OpenAiRequest] = []
        self.protocol_errors: list[str] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def _client(self, url: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=url,
            api_key=self.api_key,
            max_retries=0,  # this requester moves to the other edge itself
            timeout=httpx2.Timeout(90.0, connect=5.0),
        )

    def repoint(self, slot: int, url: str) -> None:
        """Send what goes to edge `slot` from now on to `url` (a load balancer's endpoint
        swapped); calls under way finish on the client they began with."""
        self._retired.append(self.clients[slot])
        self.clients[slot] = self._client(url)

    def submit(self, planned: Planned) -> None:
        request = OpenAiRequest(planned, len(self.requests))
        self.requests.append(request)
        serve = self._stream if self.channel == "openai-stream" else self._call
        task = asyncio.create_task(serve(request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def settled(self) -> bool:
        return all(r.settled for r in self.requests)

    def histories(self) -> list[History]:
        return [
            History(
                self.id_of(r),
                self.channel,  # type: ignore[arg-type]
                r.planned.expected_text_of(sim_prompt(r.planned)),
                tuple(r.events),
            )
            for r in self.requests
            if r.refused is None and r.sent_at is not None
        ]

    def id_of(self, r: OpenAiRequest) -> str:
        """The id `r`'s history is judged under: its request id, else (refused or cut before
        one was read) its channel and index."""
        return r.request_id or f"{self.channel}-{r.index}"

    def samples(self, zero: float) -> list[Sample]:
        """One per request handed to it (tests/chaos/availability.py)."""
        out = []
        for r in self.requests:
            accepted = r.refused is None and (r.accepted_at is not None or r.outcome is not None)
            out.append(
                Sample(
                    self.channel,  # type: ignore[arg-type]
                    sent_at_s=r.planned.at_s if r.sent_at is None else r.sent_at - zero,
                    ttft_s=_elapsed(r.sent_at, r.first_token_at),
                    accepted=accepted,
                    answered=accepted and r.outcome == "done",
                    final_code=r.refused or r.outcome,
                )
            )
        return out

    def seen(self) -> dict[str, int]:
        """What the faults showed this requester: SSE error events, resumes, resends."""
        if self.channel == "openai-stream":
            return {
                "sse_error_events": sum(len(r.error_events_at) for r in self.requests),
                "sse_resumed_streams": sum(r.resumes for r in self.requests),
            }
        return {"openai_resent_calls": sum(r.resent for r in self.requests)}

    def counts(self) -> dict[str, int]:
        """The requests not judged: refused before acceptance, by status."""
        refused = Counter(r.refused for r in self.requests if r.refused)
        return {f"{self.channel}_refused_{code}": n for code, n in sorted(refused.items())}

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in (*self.clients, *self._retired):
            await client.close()

    def _body(self, planned: Planned) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": planned.prompt}],
            "max_tokens": planned.max_tokens,
            "extra_body": {"priority": planned.priority},
        }

    async def _stream(self, r: OpenAiRequest) -> None:
        edge = r.index % len(self.clients)
        refusals = 0
        r.sent_at = time.monotonic()
        while not r.final:
            headers = dict(EVENT_IDS)
            if r.resume_token is not None:
                headers["X-Tokenbus-Resume-Token"] = r.resume_token
                headers["Last-Event-ID"] = r.last_id or "0:-1"
            try:
                async with self.clients[edge].chat.completions.with_streaming_response.create(
                    **self._body(r.planned), stream=True, extra_headers=headers
                ) as response:
                    refusals = 0
                    if r.resume_token is None:
                        r.request_id = response.headers["X-Request-Id"]
                        r.resume_token = response.headers["X-Tokenbus-Resume-Token"]
                        r.accepted_at = time.monotonic()
                    else:
                        r.resumes += 1
                        r.events.append({"resumed": r.last_id, "edge": edge})
                    async for event_id, data in sse_events(response.iter_lines()):
                        r.take(event_id, data)
                        if r.final:
                            return
                r.events.append({"dropped": "the stream ended without [DONE]", "edge": edge})
            except openai.APIStatusError as exc:
                if r.resume_token is None and exc.status_code in REFUSALS:
                    if self.retry_refused:
                        await self._after_refusal(exc)
                        edge = (edge + 1) % len(self.clients)
                        continue
                    r.refused = str(exc.status_code)
                    return
                if r.resume_token is not None and exc.status_code == 503:
                    refusals += 1  # the resume could not read the stream now: again
                    first, cap = RESUME_RETRY_S
                    await asyncio.sleep(min(cap, first * 2 ** (refusals - 1)))
                    continue
                r.finish({"status": exc.status_code, "code": _code(exc)})
                return
            except (openai.APIConnectionError, httpx2.HTTPError) as exc:
                r.events.append({"dropped": type(exc).__name__, "edge": edge})
            edge = (edge + 1) % len(self.clients)
            await asyncio.sleep(MOVE_PAUSE_S)

    async def _call(self, r: OpenAiRequest) -> None:
        edge = r.index % len(self.clients)
        r.sent_at = time.monotonic()
        while True:
            try:
                answer = await self.clients[edge].chat.completions.create(**self._body(r.planned))
            except openai.APIStatusError as exc:
                if exc.status_code in REFUSALS and self.retry_refused:
                    await self._after_refusal(exc)
                    edge = (edge + 1) % len(self.clients)
                    continue
                if exc.status_code in REFUSALS:
                    r.refused = str(exc.status_code)
                else:
                    r.finish({"status": exc.status_code, "code": _code(exc)})
                return
            except openai.APIConnectionError as exc:
                r.resent += 1
                r.events.append({"dropped": type(exc).__name__, "edge": edge})
                edge = (edge + 1) % len(self.clients)
                await asyncio.sleep(MOVE_PAUSE_S)
                continue
            r.request_id = answer.id.removeprefix("chatcmpl-")
            r.accepted_at = r.first_token_at = time.monotonic()
            choice = answer.choices[0]
            text, finish = choice.message.content or "", choice.finish_reason
            r.finish({"answer": text, "finish_reason": finish})
            return

    async def _after_refusal(self, exc: openai.APIStatusError) -> None:
        self.refusals_retried += 1
        hint = exc.response.headers.get("retry-after-ms")
        await asyncio.sleep(min(4.0, float(hint) / 1000) if hint else 1.0)


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str | None, str]]:
    """(id, data) of each server-sent event; comments (keep-alives) skipped."""
    event_id: str | None = None
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    if data:
        yield event_id, "\n".join(data)


def _elapsed(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def _code(exc: openai.APIStatusError) -> str:
    """The tokenbus error code an error answer carries (its `error.code`), else its status."""
    return exc.code or str(exc.status_code)
