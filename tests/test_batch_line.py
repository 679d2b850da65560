"""A batch line asked through the gateway (services/edge/batch_line.py), against a fake
gateway that answers from a script: no Kafka. A server error is asked again under a new
request id, up to MAX_ASKS; a refusal of the moment waits and asks again; the line's own
error is its outcome; every request names its batch line, in the background tier."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

from services.edge.batch_line import MAX_ASKS, LineAsker
from services.edge.openai.routes import HttpClient
from services.edge.protocol import AcceptedFrame, DeltaFrame, DoneFrame, ErrorFrame, ServerFrame
from shared.batch_jobs import BatchJob, BatchObject
from shared.messages import ChatRequest, ErrorCode, RequestLimits, Tier, Timings, Usage

LINE = json.dumps(
    {
        "custom_id": "q-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    }
).encode()


class FakeModels:
    def served(self, now: float) -> dict[str, int]:
        return {"m": 0}


class FakeGateway:
    """Answers the n-th request with the n-th script: frames sent to its client at once."""

    def __init__(self, scripts: list[list[ServerFrame]]) -> None:
        self.models = FakeModels()
        self.asked: list[ChatRequest] = []
        self._scripts: Iterator[list[ServerFrame]] = iter(scripts)

    async def submit_line(self, request: ChatRequest, *, client: HttpClient, **_: Any) -> None:
        self.asked.append(request)
        for frame in next(self._scripts):
            client.send(frame)

    def written(self, frame: ServerFrame, stream: object) -> None:
        pass


def accepted(rid: str) -> AcceptedFrame:
    return AcceptedFrame(request_id=rid, resume_token="t", tier=Tier.background)


def done(rid: str) -> list[ServerFrame]:
    return [
        accepted(rid),
        DeltaFrame(request_id=rid, seq=0, text="hello"),
        DoneFrame(
            request_id=rid,
            finish_reason="length",
            usage=Usage(prompt_tokens=3, completion_tokens=1),
            timings=Timings(queue_ms=1, batch_size=1, ttft_ms=2, total_ms=3),
        ),
    ]


def failed(rid: str, code: ErrorCode) -> list[ServerFrame]:
    return [accepted(rid), ErrorFrame(code=code, message="boom", request_id=rid)]


def ask(scripts: list[list[ServerFrame]]) -> tuple[Any, FakeGateway]:
    gateway = FakeGateway(scripts)
    job = BatchJob(
        batch=BatchObject(
            id="batch_ab", endpoint="/v1/chat/completions", input_file_id="f", created_at=0,
            expires_at=2**31,
        ),
        tenant="acme",
    )  # fmt: skip
    asker = LineAsker(gateway, job, RequestLimits())  # type: ignore[arg-type]
    return asyncio.run(asker.ask(LINE)), gateway


def test_a_server_error_is_asked_again_under_a_new_id_and_the_answer_kept() -> None:
    asked, gateway = ask([failed("r1", ErrorCode.internal), done("r2")])
    assert asked.ok
    assert asked.output["custom_id"] == "q-1"
    assert asked.output["response"]["request_id"] == "r2"
    assert asked.output["response"]["body"]["choices"][0]["message"]["content"] == "hello"
    assert [r.batch_line.custom_id for r in gateway.asked if r.batch_line] == ["q-1", "q-1"]
    assert {r.priority for r in gateway.asked} == {Tier.background}


def test_after_max_asks_the_server_error_is_the_lines_outcome() -> None:
    scripts = [failed(f"r{i}", ErrorCode.internal) for i in range(MAX_ASKS)]
    asked, gateway = ask(scripts)
    assert not asked.ok
    assert asked.output["response"]["status_code"] == 500
    assert len(gateway.asked) == MAX_ASKS


def test_the_lines_own_error_is_its_outcome_at_once() -> None:
    refused = [ErrorFrame(code=ErrorCode.invalid_request, message="no such model")]
    asked, gateway = ask([refused])
    assert not asked.ok
    assert asked.output["response"]["status_code"] == 400
    assert len(gateway.asked) == 1
