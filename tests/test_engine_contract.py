"""One contract for every engine: stream order, usage, max_tokens, stop, abort, priority."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from services.worker.engines.base import (
    Engine,
    EngineDelta,
    EngineFinish,
    EngineOutput,
    EngineRequest,
)
from tests.engine_contract import EngineCase, available_engines

CASES = available_engines()


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def case(request: pytest.FixtureRequest) -> EngineCase:
    chosen: EngineCase = request.param
    return chosen


async def started(case: EngineCase, max_num_seqs: int) -> Engine:
    engine = case.build(max_num_seqs)
    await engine.start()
    return engine


async def collect(engine: Engine, request: EngineRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(request)]


def req(
    rid: str, prompt: str, max_tokens: int | None, stop: tuple[str, ...] = (), priority: int = 0
) -> EngineRequest:
    """Greedy (temperature 0), so real models give the same text on every run."""
    return EngineRequest(rid, prompt, max_tokens, temperature=0.0, stop=stop, priority=priority)


def text_of(outputs: list[EngineOutput]) -> str:
    return "".join(o.text for o in outputs if isinstance(o, EngineDelta))


def check_stream(outputs: list[EngineOutput]) -> EngineFinish:
    """Deltas, then exactly one finish, last; usage matches the deltas."""
    assert outputs, "a stream must end with a finish"
    *deltas, finish = outputs
    assert isinstance(finish, EngineFinish), outputs[-3:]
    assert all(isinstance(d, EngineDelta) for d in deltas), "finish must be last and alone"
    assert sum(d.tokens for d in deltas if isinstance(d, EngineDelta)) == finish.completion_tokens
    assert finish.prompt_tokens > 0
    return finish


async def wait_for(predicate: Callable[[], bool], what: str, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


async def test_concurrent_streams_keep_order_and_usage(case: EngineCase) -> None:
    engine = await started(case, max_num_seqs=4)
    try:
        requests = [req(f"r{i}", f"tell me about buses {i}", 12 + i) for i in range(6)]
        streams = await asyncio.gather(*(collect(engine, r) for r in requests))
        for request, outputs in zip(requests, streams, strict=True):
            finish = check_stream(outputs)
            assert finish.completion_tokens <= request.max_tokens
            assert finish.finish_reason in ("stop", "length")
            if case.expected_text is not None:
                assert text_of(outputs) == case.expected_text(request)
    finally:
        await engine.stop()


async def test_max_tokens_is_honoured(case: EngineCase) -> None:
    engine = await started(case, max_num_seqs=2)
    try:
        outputs = await collect(engine, req("m", "a long answer please", 5))
        finish = check_stream(outputs)
        assert finish.completion_tokens <= 5
        if finish.completion_tokens == 5:
            assert finish.finish_reason == "length"
        else:
            assert finish.finish_reason == "stop"  # the model ended first (EOS)
    finally:
        await engine.stop()


async def test_stop_string_ends_the_stream_before_it(case: EngineCase) -> None:
    engine = await started(case, max_num_seqs=2)
    try:
        full = text_of(await collect(engine, req("free", "stop test prompt", 40)))
        assert len(full) > 12, full
        stop = full[8:11]
        cut = full[: full.index(stop)]
        outputs = await collect(engine, req("stopped", "stop test prompt", 40, stop=(stop,)))
        finish = check_stream(outputs)
        assert finish.finish_reason == "stop"
        assert text_of(outputs) == cut
        assert stop not in text_of(outputs)
    finally:
        await engine.stop()


async def test_abort_ends_the_stream_and_frees_the_slot(case: EngineCase) -> None:
    engine = await started(case, max_num_seqs=2)
    try:
        before = engine.capacity().free_slots
        stream = engine.generate(req("long", "a very long story", None))  # to the context's end
        first = await anext(stream)
        assert isinstance(first, EngineDelta)
        assert engine.capacity().free_slots == before - 1
        assert await engine.abort("long") is True
        assert engine.capacity().free_slots == before, "abort must free the slot at once"
        rest = [out async for out in stream]
        assert isinstance(rest[-1], EngineFinish)
        assert rest[-1].finish_reason == "cancelled"
        assert await engine.abort("long") is False
    finally:
        await engine.stop()


async def test_priority_orders_the_queue_when_slots_are_short(case: EngineCase) -> None:
    engine = await started(case, max_num_seqs=1)
    order: list[str] = []

    async def run(stream: AsyncIterator[EngineOutput], name: str) -> None:
        async for out in stream:
            if isinstance(out, EngineDelta) and name not in order:
                order.append(name)

    try:
        filler = engine.generate(req("filler", "keep the only slot busy", None))
        assert isinstance(await anext(filler), EngineDelta)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(run(engine.generate(req("low", "background job", 4, priority=1)), "low"))
            await wait_for(lambda: engine.capacity().queued >= 1, "low to queue")
            tg.create_task(run(engine.generate(req("high", "interactive", 4, priority=0)), "high"))
            await wait_for(lambda: engine.capacity().queued >= 2, "high to queue")
            await engine.abort("filler")
        await filler.aclose()  # type: ignore[attr-defined]
        assert order == ["high", "low"]
    finally:
        await engine.stop()


async def test_sampled_requests_keep_the_contract(case: EngineCase) -> None:
    engine = await started(case, max_num_seqs=2)
    try:
        request = EngineRequest("s", "sample something", 9, temperature=0.8, top_p=0.9)
        finish = check_stream(await collect(engine, request))
        assert finish.completion_tokens <= 9
        assert finish.finish_reason in ("stop", "length")
    finally:
        await engine.stop()
