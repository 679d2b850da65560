"""Every engine that runs a batch as one call (`StaticEngine`): sim always, transformers where
torch is installed (a tiny random Llama on CPU, tests/engine_contract.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.worker.engines.base import (
    EngineDelta,
    EngineFinish,
    EngineOutput,
    EngineRequest,
    PromptTooLong,
    StaticEngine,
)
from tests.engine_contract import EngineCase, available_engines
from tests.test_engine_contract import wait_for

STATIC_CASES = [c for c in available_engines() if c.name.startswith(("sim-h200", "transformers"))]


def _build(case: EngineCase, slots: int) -> StaticEngine:
    engine = case.build(slots)
    assert isinstance(engine, StaticEngine)
    return engine


async def _collect(stream: AsyncIterator[EngineOutput]) -> tuple[list[str], EngineFinish]:
    text: list[str] = []
    async for out in stream:
        if isinstance(out, EngineFinish):
            return text, out
        assert isinstance(out, EngineDelta)
        text.append(out.text)
    raise AssertionError("no finish")


@pytest.mark.parametrize("case", STATIC_CASES, ids=lambda c: c.name)
async def test_a_padded_batch_streams_every_row_to_its_own_length(case: EngineCase) -> None:
    engine = _build(case, 4)
    await engine.start()
    try:
        requests = [
            EngineRequest("r0", "hello there", 4, temperature=0.0),
            EngineRequest("r1", "a much longer prompt than the first one", 12, temperature=0.0),
            EngineRequest("r2", "mid", 7, temperature=0.0),
        ]
        streams = engine.generate_batch(requests)
        assert engine.capacity().running + engine.capacity().queued == 3
        results = await asyncio.gather(*(_collect(s) for s in streams))
        for request, (deltas, finish) in zip(requests, results, strict=True):
            # Streamed per row as the batch steps, not handed over at the end.
            assert len(deltas) > 1
            if case.expected_text is not None:
                assert "".join(deltas) == case.expected_text(request)
            else:  # the random model never picks EOS: every row runs to its max_tokens
                assert finish.finish_reason == "length"
                assert finish.completion_tokens == request.max_tokens
            assert finish.prompt_tokens > 0
        # The batch's slots free once the batch itself has ended (its last step, its call).
        await wait_for(lambda: engine.capacity().free_slots == 4, "the batch's slots", 30)
        assert engine.capacity().running == 0
    finally:
        await engine.stop()


@pytest.mark.parametrize("case", STATIC_CASES, ids=lambda c: c.name)
async def test_an_aborted_row_ends_alone_and_a_too_long_one_is_refused(case: EngineCase) -> None:
    engine = _build(case, 4)
    await engine.start()
    try:
        long_prompt = "word " * 10_000
        streams = engine.generate_batch(
            [
                EngineRequest("keep", "keep going", 10, temperature=0.0),
                EngineRequest("stop", "stop early", 200, temperature=0.0),
                EngineRequest("huge", long_prompt, 5, temperature=0.0),
            ]
        )
        with pytest.raises(PromptTooLong):
            await anext(streams[2])
        assert isinstance(await anext(streams[1]), EngineDelta)
        assert await engine.abort("stop") is True
        rest = [o async for o in streams[1]]
        assert isinstance(rest[-1], EngineFinish)
        assert rest[-1].finish_reason == "cancelled"
        _, finish = await _collect(streams[0])
        assert finish.completion_tokens > 0
    finally:
        await engine.stop()
