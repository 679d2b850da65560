"""Issue 38, item 2, the pure parts: the watch that takes a dead or hung engine for a sick
worker, and the sim's engine faults that tests play (services/worker/engine_health.py,
services/worker/engines/sim.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.worker.engine_health import EngineWatch
from services.worker.engines.base import (
    EngineDelta,
    EngineOutput,
    EngineRequest,
    engine_failure,
)
from services.worker.engines.sim import SimEngine, SimulatedFault
from services.worker.engines.sim_profiles import SimProfile

STALL_S = 30.0


def strike(fault_file: Path, fault: str) -> None:
    """Ask the sim engine for `fault` (`dead`, `hang`) through its fault file."""
    fault_file.write_text(fault)


async def read_to_end(stream: AsyncIterator[EngineOutput]) -> None:
    async for _ in stream:
        pass


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeRuns:
    """What the watch reads of the running requests: how many, and their last progress."""

    def __init__(self) -> None:
        self.held = 0
        self.progressed_at = float("-inf")

    def __len__(self) -> int:
        return self.held

    def progress(self) -> tuple[int, float]:
        return self.held, self.progressed_at


def test_an_engine_holding_work_without_output_past_the_stall_is_sick() -> None:
    clock, runs = FakeClock(), FakeRuns()
    watch = EngineWatch(SimEngine(), runs, STALL_S, clock)
    assert watch.problem() is None  # idle: silence is no sign
    runs.held, runs.progressed_at = 3, clock.now
    clock.now += STALL_S
    assert watch.problem() is None
    clock.now += 1
    assert "no output for 31 s while it held 3 requests" in (watch.problem() or "")
    runs.progressed_at = clock.now  # one output of any request is progress
    assert watch.problem() is None


async def test_the_sims_dead_fault_fails_every_request_and_says_the_engine_died(
    tmp_path: Path,
) -> None:
    fault = tmp_path / "fault"
    engine = SimEngine(SimProfile(token_rate=200.0, max_num_seqs=4), fault_file=str(fault))
    watch = EngineWatch(engine, FakeRuns(), STALL_S)
    await engine.start()
    try:
        streams = [
            engine.generate(EngineRequest(f"r{i}", "a long one", None, ignore_eos=True))
            for i in range(2)
        ]
        for stream in streams:  # each has begun
            assert isinstance(await anext(stream), EngineDelta)
        assert watch.problem() is None
        strike(fault, "dead\n")
        for stream in streams:
            with pytest.raises(SimulatedFault):
                async for _ in stream:
                    pass
        assert not fault.exists()  # read once: a restarted engine is well again
        assert engine_failure(engine) == "dead (sim fault injection)"
        assert "the engine died" in (watch.problem() or "")
        with pytest.raises(SimulatedFault, match="dead"):
            await anext(engine.generate(EngineRequest("late", "after", 4)))
    finally:
        await engine.stop()


async def test_the_sims_hang_fault_stops_every_output_and_is_no_death(tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    engine = SimEngine(SimProfile(token_rate=200.0, max_num_seqs=4), fault_file=str(fault))
    await engine.start()
    try:
        stream = engine.generate(EngineRequest("r1", "a long one", None, ignore_eos=True))
        assert isinstance(await anext(stream), EngineDelta)
        strike(fault, "hang")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(read_to_end(stream), 2.0)
        assert not fault.exists()
        assert engine_failure(engine) is None
    finally:
        await engine.stop()


async def test_a_sick_engine_sends_the_last_beat_then_ends_the_process(tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    engine = SimEngine(SimProfile(token_rate=200.0, max_num_seqs=1), fault_file=str(fault))
    ended: list[str] = []
    beats: list[str] = []
    watch = EngineWatch(engine, FakeRuns(), STALL_S, end=lambda: ended.append("ended"))

    async def last_beat() -> None:
        beats.append("no free slot")

    await engine.start()
    try:
        stream = engine.generate(EngineRequest("r1", "a long one", None, ignore_eos=True))
        await anext(stream)
        strike(fault, "dead")
        await asyncio.wait_for(watch.run(last_beat), 10)
        await stream.aclose()
    finally:
        await engine.stop()
    assert beats == ["no free slot"]
    assert ended == ["ended"]
    assert watch.sick is not None
    assert watch.sick.startswith("the engine died")


async def test_the_sims_dead_fault_is_seen_while_the_engine_is_idle(tmp_path: Path) -> None:
    # A chaos run struck a worker that held no work: its engine read the fault only at its
    # next step, the worker did not exit, and the next fault found it still there. vLLM's
    # engine core dies idle too, and `errored` says so at once.
    fault = tmp_path / "fault"
    engine = SimEngine(SimProfile(token_rate=200.0, max_num_seqs=4), fault_file=str(fault))
    await engine.start()
    try:
        strike(fault, "dead")
        deadline = asyncio.get_running_loop().time() + 5.0
        while engine_failure(engine) is None:
            assert asyncio.get_running_loop().time() < deadline, "an idle engine never died"
            await asyncio.sleep(0.05)
        assert engine_failure(engine) == "dead (sim fault injection)"
        assert not fault.exists()
    finally:
        await engine.stop()
