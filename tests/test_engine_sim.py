"""The sim engine's cost model and its two batching modes."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from services.worker.engines.base import (
    EngineDelta,
    EngineFinish,
    EngineRequest,
    FieldNotHonoured,
    PromptTooLong,
)
from services.worker.engines.sim import SimEngine, paced_rate
from services.worker.engines.sim_profiles import PROFILES, SimProfile, sim_profile

H100 = PROFILES["llama3-8b-h100"]
H200 = PROFILES["llama3-8b-h200"]
WEIGHTS = 8.03e9 * 2  # bytes, bf16
KV_PER_TOKEN = 131072  # bytes: 2 x 32 layers x 8 heads x 128 dims x 2 bytes


def test_h100_decode_step_is_weight_reads_at_achieved_bandwidth() -> None:
    assert H100.step_seconds(1, 0) == pytest.approx(0.0005 + WEIGHTS / (3.35e12 * 0.8))
    assert H100.step_seconds(1, 0) == pytest.approx(0.006492, abs=1e-6)


def test_kv_tokens_add_memory_time() -> None:
    extra = H100.step_seconds(16, 10_000) - H100.step_seconds(16, 0)
    assert extra == pytest.approx(10_000 * KV_PER_TOKEN / (3.35e12 * 0.8))


def test_large_prefill_is_compute_bound() -> None:
    step = H100.step_seconds(0, 512, prefill_tokens=512)
    assert step == pytest.approx(0.0005 + 512 * 2 * 8.03e9 / (989e12 * 0.5))


def test_h200_steps_faster_than_h100_by_its_bandwidth() -> None:
    assert H200.step_seconds(16, 0) < H100.step_seconds(16, 0)
    ratio = (H100.step_seconds(1, 0) - 0.0005) / (H200.step_seconds(1, 0) - 0.0005)
    assert ratio == pytest.approx(4.8 / 3.35)


def test_constant_profile_ignores_load() -> None:
    p = SimProfile(token_rate=100.0)
    assert p.step_seconds(1, 0) == p.step_seconds(64, 100_000, 4096) == pytest.approx(0.01)


def test_unknown_profile_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown sim profile"):
        sim_profile("llama3-8b-tpu", max_num_seqs=4, token_rate=1.0)


async def first_tokens_and_ends(mode: str) -> list[str]:
    """Events of two requests, the second submitted after the first's first token."""
    engine = SimEngine(SimProfile(token_rate=500.0, max_num_seqs=4), mode)  # type: ignore[arg-type]
    await engine.start()
    events: list[str] = []

    async def follow(name: str, request: EngineRequest, started: asyncio.Event) -> None:
        async for out in engine.generate(request):
            if isinstance(out, EngineDelta) and f"{name}:first" not in events:
                events.append(f"{name}:first")
                started.set()
            if isinstance(out, EngineFinish):
                events.append(f"{name}:end")

    try:
        a_started, b_started = asyncio.Event(), asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow("a", EngineRequest("a", "first request", 20), a_started))
            await a_started.wait()
            tg.create_task(follow("b", EngineRequest("b", "second request", 3), b_started))
    finally:
        await engine.stop()
    return events


async def test_continuous_mode_lets_requests_join_at_the_next_step() -> None:
    events = await first_tokens_and_ends("continuous")
    assert events.index("b:first") < events.index("a:end")
    assert events.index("b:end") < events.index("a:end")


async def test_static_mode_waits_for_the_running_batch_to_finish() -> None:
    events = await first_tokens_and_ends("static")
    assert events == ["a:first", "a:end", "b:first", "b:end"]


async def test_static_batch_rows_share_steps_and_aborted_rows_stay_until_the_end() -> None:
    engine = SimEngine(SimProfile(token_rate=500.0, max_num_seqs=4), "static")
    await engine.start()
    try:
        long = engine.generate(EngineRequest("long", "long", 30))
        short = engine.generate(EngineRequest("short", "short", 2))
        # Submit both before the engine's next step, so they form one batch.
        long_first = asyncio.ensure_future(anext(long))
        short_first = asyncio.ensure_future(anext(short))
        assert isinstance(await long_first, EngineDelta)
        assert isinstance(await short_first, EngineDelta)
        short_out = [o async for o in short]
        assert isinstance(short_out[-1], EngineFinish)
        # The short row is done, but the batch keeps running until its longest row ends.
        late = engine.generate(EngineRequest("late", "late", 2))
        late_first = asyncio.ensure_future(anext(late))
        await asyncio.sleep(0.02)
        assert not late_first.done()
        assert await engine.abort("long") is True
        assert isinstance(await late_first, EngineDelta)
        await late.aclose()  # type: ignore[attr-defined]
        await long.aclose()  # type: ignore[attr-defined]
    finally:
        await engine.stop()


class RecordingSink:
    """An `OutputSink` that keeps what it was pushed, and says when the finish came."""

    def __init__(self) -> None:
        self.outputs: list[EngineDelta | EngineFinish] = []
        self.errors: list[Exception] = []
        self.ended = asyncio.Event()
        self.first = asyncio.Event()

    def on_output(self, out: EngineDelta | EngineFinish) -> None:
        assert not self.ended.is_set(), "an output after the finish"
        self.outputs.append(out)
        self.first.set()
        if isinstance(out, EngineFinish):
            self.ended.set()

    def on_error(self, error: Exception) -> None:
        self.errors.append(error)
        self.ended.set()


async def test_pushed_outputs_are_the_streamed_ones_step_by_step() -> None:
    request = EngineRequest("r1", "push me the same tokens", max_tokens=12, seed=7)
    engine = SimEngine(SimProfile(token_rate=2000.0, max_num_seqs=4))
    await engine.start()
    try:
        streamed = [out async for out in engine.generate(request)]
        sink = RecordingSink()
        engine.submit(request, sink)
        await asyncio.wait_for(sink.ended.wait(), 10)
    finally:
        await engine.stop()
    pushed = sink.outputs
    last = pushed[-1]
    assert isinstance(last, EngineFinish)
    assert "".join(o.text for o in pushed if isinstance(o, EngineDelta)) == "".join(
        o.text for o in streamed if isinstance(o, EngineDelta)
    )
    assert pushed[-1] == streamed[-1] == EngineFinish("length", last.prompt_tokens, 12)
    # One delta per step: a token reaches the sink as it is made, never merged or held back.
    assert [o.tokens for o in pushed if isinstance(o, EngineDelta)] == [1] * 12
    assert not sink.errors


async def test_abort_pushes_a_cancelled_finish_and_frees_the_slot() -> None:
    engine = SimEngine(SimProfile(token_rate=200.0, max_num_seqs=1))
    await engine.start()
    try:
        sink = RecordingSink()
        engine.submit(EngineRequest("r1", "a long one", max_tokens=None), sink)  # the context
        await asyncio.wait_for(sink.first.wait(), 10)
        assert await engine.abort("r1")
        assert sink.ended.is_set()  # pushed at once, by the abort itself
        finish = sink.outputs[-1]
        assert isinstance(finish, EngineFinish)
        assert finish.finish_reason == "cancelled"
        assert engine.capacity().free_slots == 1
        assert not await engine.abort("r1")
    finally:
        await engine.stop()


async def test_a_prompt_over_the_context_is_refused_by_submit_itself() -> None:
    engine = SimEngine(SimProfile(token_rate=200.0, max_num_seqs=1, context_length=4))
    await engine.start()
    try:
        with pytest.raises(PromptTooLong):
            engine.submit(EngineRequest("r1", "one two three four five six", 5), RecordingSink())
        assert engine.capacity().queued == 0
    finally:
        await engine.stop()


async def test_logprobs_are_refused_unless_the_sim_is_told_to_make_them_up() -> None:
    request = EngineRequest("r1", "weigh these tokens", max_tokens=6, logprobs=20)
    with pytest.raises(FieldNotHonoured, match="logprobs"):
        SimEngine().submit(request, RecordingSink())
    engine = SimEngine(SimProfile(token_rate=2000.0, max_num_seqs=4), logprobs=True)
    assert "logprobs" in engine.sampling_fields
    assert "logprobs" not in SimEngine.sampling_fields
    await engine.start()
    try:
        outputs = [out async for out in engine.generate(request)]
        plain = [o async for o in engine.generate(EngineRequest("r2", "weigh", max_tokens=3))]
    finally:
        await engine.stop()
    deltas = [o for o in outputs if isinstance(o, EngineDelta)]
    given = [lp for d in deltas for lp in d.logprobs or ()]
    # One per token, in order, with the 20 alternatives asked, the chosen one first.
    assert [lp.token for lp in given] == [d.text for d in deltas]
    assert len(given) == 6
    assert all(len(lp.top) == 20 and lp.top[0].token == lp.token for lp in given)
    assert all(lp.top[i].logprob > lp.top[i + 1].logprob for lp in given for i in range(19))
    assert all(o.logprobs is None for o in plain if isinstance(o, EngineDelta))


PACE = "SIMPACE-test"


@pytest.mark.parametrize(
    ("prompt", "marker", "rate"),
    [
        (f"hi {PACE}=20 there", PACE, 20.0),
        (f"{PACE}=2.5", PACE, 2.5),
        (f"{PACE}=0", PACE, None),  # not a rate: the engine's own pace
        (f"{PACE}=fast", PACE, None),
        ("no marker here", PACE, None),
        (f"{PACE}=20", None, None),  # unset (production): a prompt cannot pace itself
    ],
)
def test_a_pace_is_read_from_the_prompt_only_where_the_marker_is_set(
    prompt: str, marker: str | None, rate: float | None
) -> None:
    assert paced_rate(prompt, marker) == rate


async def steps_of_each_token(marker: str | None) -> tuple[list[int], list[int], str]:
    """Two requests in one continuous batch on a 1,000-steps-a-second engine: one asking for
    100 tokens/s, one not. The engine's step count at each token of each; the paced text."""
    engine = SimEngine(SimProfile(token_rate=1000.0, max_num_seqs=4), rate_marker=marker)
    await engine.start()
    paced, plain = RecordingSink(), RecordingSink()
    steps: dict[str, list[int]] = {"paced": [], "plain": []}

    def at_step(name: str, sink: RecordingSink) -> RecordingSink:
        on_output = sink.on_output

        def record(out: EngineDelta | EngineFinish) -> None:
            if isinstance(out, EngineDelta):
                steps[name].append(engine.steps)
            on_output(out)

        sink.on_output = record  # type: ignore[method-assign]
        return sink

    try:
        engine.submit(EngineRequest("p", f"slow one {PACE}=100", 5), at_step("paced", paced))
        engine.submit(EngineRequest("q", "fast one", 20), at_step("plain", plain))
        await asyncio.wait_for(asyncio.gather(paced.ended.wait(), plain.ended.wait()), 10)
    finally:
        await engine.stop()
    text = "".join(o.text for o in paced.outputs if isinstance(o, EngineDelta))
    finish = paced.outputs[-1]
    assert isinstance(finish, EngineFinish)
    assert (finish.finish_reason, finish.completion_tokens) == ("length", 5)
    return steps["paced"], steps["plain"], text


async def test_a_paced_request_emits_on_fewer_steps_of_the_same_batch() -> None:
    paced, plain, text = await steps_of_each_token(PACE)
    # 100 tokens/s on 1 ms steps: a token every 10th step; the other one every step.
    assert [b - a for a, b in itertools.pairwise(paced)] == [10] * 4, paced
    assert [b - a for a, b in itertools.pairwise(plain)] == [1] * 19, plain
    assert paced[0] - plain[0] == 9  # both joined at the same step
    assert plain[-1] < paced[2], "the unpaced request did not wait for the paced one"
    # The pace changes when its tokens come, never which: the same text unpaced.
    unpaced, _, same = await steps_of_each_token(None)
    assert [b - a for a, b in itertools.pairwise(unpaced)] == [1] * 4
    assert same == text
