"""Static batches: the sim's per-batch cost model, a batch as one engine call, the heartbeat."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.scheduler.workers import WorkerRegistry
from services.worker.engines.base import (
    Capacity,
    EngineDelta,
    EngineFinish,
    EngineOutput,
    EngineRequest,
    PromptTooLong,
    StaticEngine,
)
from services.worker.engines.factory import build_engine, static_engine
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_profiles import PROFILES, SimProfile
from services.worker.heartbeat import free_slots
from services.worker.outbox import ResultOutbox
from services.worker.runner import engine_request
from services.worker.settings import WorkerSettings
from shared.messages import DoneResult
from tests.test_scheduler_workers import beat
from tests.test_worker_runner import UNTRACED, FakeProducer, request, runner_of

H100 = PROFILES["llama3-8b-h100"]


# -- the cost model ------------------------------------------------------------------------


def test_padded_prefill_costs_rows_times_the_longest_prompt() -> None:
    # One short prompt among long ones costs as much as a long one: it is padded.
    assert H100.padded_prefill_seconds(8, 1000) == H100.step_seconds(0, 8000, 8000)
    mixed = H100.static_batch_seconds([10] + [1000] * 7, [1] * 8)
    uniform = H100.static_batch_seconds([1000] * 8, [1] * 8)
    assert mixed.first_token_s == uniform.first_token_s
    # Compute-bound: eight 1000-token rows take far longer than the weights' read alone.
    assert H100.padded_prefill_seconds(8, 1000) > 4 * H100.padded_prefill_seconds(1, 100)


def test_every_row_decodes_until_the_longest_output_ends() -> None:
    timing = H100.static_batch_seconds([100, 100, 100], [5, 200, 50])
    assert timing.row_done_s[0] < timing.row_done_s[2] < timing.row_done_s[1]
    assert timing.batch_s == timing.row_done_s[1]
    # A batch's steps cost the same whether its short rows are done or not: all are padded.
    alone = H100.static_batch_seconds([100, 100, 100], [200, 200, 200])
    assert alone.batch_s == timing.batch_s


@given(rows=st.lists(st.tuples(st.integers(1, 4000), st.integers(1, 300)), min_size=1, max_size=32))
def test_static_timeline_is_ordered(rows: list[tuple[int, int]]) -> None:
    prompts, outputs = [p for p, _ in rows], [o for _, o in rows]
    timing = H100.static_batch_seconds(prompts, outputs)
    assert 0 < timing.first_token_s <= min(timing.row_done_s)
    assert max(timing.row_done_s) == timing.batch_s
    by_output = sorted(zip(outputs, timing.row_done_s, strict=True))
    assert [d for _, d in by_output] == sorted(d for _, d in by_output)
    # One more row never makes the batch faster.
    wider = H100.static_batch_seconds([*prompts, max(prompts)], [*outputs, 1])
    assert wider.batch_s >= timing.batch_s


# -- the sim runs a batch as one call --------------------------------------------------------


async def _trace(
    engine: SimEngine, name: str, stream: AsyncIterator[EngineOutput], events: list[str]
) -> EngineFinish:
    async for out in stream:
        if isinstance(out, EngineDelta) and f"{name}:first" not in events:
            events.append(f"{name}:first@{engine.steps}")
            events.append(f"{name}:first")
        if isinstance(out, EngineFinish):
            events.append(f"{name}:end")
            return out
    raise AssertionError("no finish")


async def test_sim_runs_a_batch_as_one_call_padded_and_one_batch_at_a_time() -> None:
    engine = SimEngine(SimProfile(token_rate=400.0, max_num_seqs=8), "continuous")
    assert isinstance(engine, StaticEngine)
    await engine.start()
    events: list[str] = []
    try:
        first = engine.generate_batch(
            [EngineRequest("short", "short one", 3), EngineRequest("long", "a long one", 40)]
        )
        second = engine.generate_batch([EngineRequest("next", "the next batch", 2)])
        cap = engine.capacity()
        assert (cap.queued, cap.free_slots) == (3, 5)
        async with asyncio.TaskGroup() as tg:
            short = tg.create_task(_trace(engine, "short", first[0], events))
            long = tg.create_task(_trace(engine, "long", first[1], events))
            nxt = tg.create_task(_trace(engine, "next", second[0], events))
            await short
            # The short row is answered, but its slot is held until the long one ends.
            assert engine.capacity().running == 2
        assert (await short).completion_tokens == 3
        assert (await long).completion_tokens == 40
        assert (await nxt).finish_reason == "length"
    finally:
        await engine.stop()
    steps = {e.split("@")[0]: int(e.split("@")[1]) for e in events if "@" in e}
    assert steps["short:first"] == steps["long:first"], "a batch's rows start together"
    order = [e for e in events if "@" not in e]
    assert order.index("short:end") < order.index("long:end") < order.index("next:first")


async def test_a_too_long_row_is_refused_alone_and_a_closed_row_frees_its_stream() -> None:
    profile = SimProfile(token_rate=400.0, max_num_seqs=4, context_length=8)
    engine = SimEngine(profile, "static")
    await engine.start()
    try:
        streams = engine.generate_batch(
            [
                EngineRequest("ok", "hi", 5),
                EngineRequest("big", "far too long a prompt " * 20, 5),
                EngineRequest("gone", "bye", None),  # to the end of the context
            ]
        )
        with pytest.raises(PromptTooLong):
            await anext(streams[1])
        assert isinstance(await anext(streams[2]), EngineDelta)
        await streams[2].aclose()  # type: ignore[attr-defined]
        outs = [o async for o in streams[0]]
        assert isinstance(outs[-1], EngineFinish)
        assert outs[-1].completion_tokens == 5
        assert await engine.abort("gone") is False  # closing it ended it
    finally:
        await engine.stop()


async def test_rows_beyond_the_slots_run_as_the_next_static_batch() -> None:
    engine = SimEngine(SimProfile(token_rate=400.0, max_num_seqs=2), "static")
    await engine.start()
    events: list[str] = []
    try:
        streams = engine.generate_batch([EngineRequest(f"r{i}", f"row {i}", 3) for i in range(3)])
        async with asyncio.TaskGroup() as tg:
            for i, stream in enumerate(streams):
                tg.create_task(_trace(engine, f"r{i}", stream, events))
    finally:
        await engine.stop()
    order = [e for e in events if "@" not in e]
    assert order.index("r1:end") < order.index("r2:first")


# -- the worker ---------------------------------------------------------------------------


def _cap(running: int, queued: int, total: int = 8) -> Capacity:
    return Capacity(total, max(0, total - running - queued), running, queued, 0, running / total)


def test_a_static_worker_advertises_all_its_slots_only_when_idle() -> None:
    assert free_slots(_cap(0, 0), 0, one_batch_at_a_time=True) == 8
    assert free_slots(_cap(2, 0), 0, one_batch_at_a_time=True) == 0
    assert free_slots(_cap(0, 0), 3, one_batch_at_a_time=True) == 0  # taken, not yet in
    assert free_slots(_cap(0, 2), 0, one_batch_at_a_time=True) == 0
    # Continuous: whatever the engine and the intake leave.
    assert free_slots(_cap(2, 0), 3, one_batch_at_a_time=False) == 5
    assert free_slots(_cap(2, 1), 0, one_batch_at_a_time=False) == 5


class FakeContinuousEngine:
    """A fake engine without `generate_batch` (as vLLM's)."""

    name = "fake"
    context_length = None
    cpu_seconds = 0.0

    async def start(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        raise NotImplementedError

    async def abort(self, request_id: str) -> bool:
        return False

    def capacity(self) -> Capacity:
        return _cap(0, 0)

    async def stop(self) -> None: ...


def _settings(mode: str) -> WorkerSettings:
    return WorkerSettings(worker_batch_mode=mode)  # type: ignore[arg-type]


def test_the_batch_mode_is_chosen_in_one_place() -> None:
    sim = SimEngine()
    assert static_engine(sim, _settings("continuous")) is None
    assert static_engine(sim, _settings("static")) is sim
    with pytest.raises(ValueError, match="cannot run a batch"):
        static_engine(FakeContinuousEngine(), _settings("static"))


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_the_sim_batches_as_the_worker_does(mode: str) -> None:
    engine = build_engine(_settings(mode))
    assert isinstance(engine, SimEngine)
    assert engine.mode == mode


@pytest.mark.parametrize("value", ["continuous", "static"])
def test_the_retired_sim_mode_variable_is_refused_naming_its_successor(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    # Unknown TOKENBUS_* variables are ignored; this one would look set and do nothing.
    monkeypatch.setenv("TOKENBUS_WORKER_SIM_MODE", value)
    with pytest.raises(ValueError, match="TOKENBUS_WORKER_SIM_MODE: no longer read") as refused:
        WorkerSettings()
    assert "TOKENBUS_WORKER_BATCH_MODE=static" in str(refused.value)


def test_a_batch_sent_to_a_static_worker_takes_all_its_slots_until_it_beats_again() -> None:
    registry = WorkerRegistry()
    registry.beat(beat(free=4, consumed=10, batch_mode="static"), now=0.0)
    registry.dispatched("w1", offset=10, requests=1)
    assert [s.free for s in registry.slots(0.0)] == [0]
    registry.beat(beat(free=0, consumed=11, batch_mode="static"), now=0.1)  # running it
    assert [s.free for s in registry.slots(0.1)] == [0]
    registry.beat(beat(free=4, consumed=11, batch_mode="static"), now=0.2)  # done
    assert [s.free for s in registry.slots(0.2)] == [4]
    # A continuous worker's free slots only lose what was sent.
    registry.beat(beat(worker="w2", free=4, consumed=10), now=0.2)
    registry.dispatched("w2", offset=10, requests=1)
    assert [s.free for s in registry.slots(0.2)] == [4, 3]


async def test_the_runner_streams_each_row_of_one_call_and_answers_it_when_its_row_ends() -> None:
    """Worker logic, Kafka faked: rows of one engine call run through the usual runner."""
    engine = SimEngine(SimProfile(token_rate=200.0, max_num_seqs=4), "static")
    producer = FakeProducer()
    queued = [
        request("a short answer", max_tokens=2).model_copy(update={"request_id": "short"}),
        request("a longer answer", max_tokens=20).model_copy(update={"request_id": "long"}),
    ]
    await engine.start()
    try:
        async with ResultOutbox(producer, resend_s=1.0) as outbox:
            runner = runner_of(engine, outbox)
            streams = engine.generate_batch([engine_request(q) for q in queued])
            steps_at_start = engine.steps
            outcomes = await asyncio.gather(
                *(
                    runner.run(q, 2, UNTRACED, stream=s)
                    for q, s in zip(queued, streams, strict=True)
                )
            )
    finally:
        await engine.stop()
    assert outcomes == ["answered", "answered"]
    finals = [r for r in producer.records() if isinstance(r, DoneResult)]
    # The short row is answered first, with its own tokens; both ran in the one batch.
    assert [f.request_id for f in finals] == ["short", "long"]
    assert finals[0].usage.completion_tokens == 2
    assert finals[1].usage.completion_tokens == 20
    assert all(f.timings.batch_size == 2 for f in finals)
    # One batch: 20 steps for the longest row (prefill included), none for the short alone.
    assert engine.steps - steps_at_start == 20
