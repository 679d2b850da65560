"""The runner's endings (pure of Kafka: a fake producer records what would be written).

Every run ends in exactly one final record, or in none and a re-run: an engine failure is
one `internal` error, a prompt over the context one `invalid_request` before the engine
sees it, a result write that fails or a fencing stops the run without a final record.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.context import Context
from prometheus_client import CollectorRegistry
from pydantic import TypeAdapter

from services.worker.engines.base import EngineDelta, EngineFinish, EngineOutput
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_profiles import sim_profile
from services.worker.engines.sim_text import complete
from services.worker.outbox import ResultOutbox
from services.worker.request_state import RunningRequests
from services.worker.runner import RequestRunner
from services.worker.telemetry import RunTrace, WorkerTelemetry
from shared.messages import (
    DeltaResult,
    DoneResult,
    ErrorResult,
    QueuedRequest,
    ReplyTo,
    ResultRecord,
    Tier,
    TokenLogprob,
)
from shared.metrics import WorkerMetrics
from tests.test_engine_health import strike

MARKER = "FAULT-HERE"
UNTRACED = RunTrace(Context(), None)
_records: TypeAdapter[ResultRecord] = TypeAdapter(ResultRecord)


def _telemetry() -> WorkerTelemetry:
    """Untraced, with its own registry: the process may hold another service's metrics."""
    return WorkerTelemetry(WorkerMetrics.build(CollectorRegistry()), recording=False)


class FakeBatch:
    """A record batch as the fake fills it: every value appended, no size limit."""

    def __init__(self) -> None:
        self.values: list[bytes] = []

    def append(self, *, key: bytes, value: bytes, timestamp: None, headers: Any) -> object:
        self.values.append(value)
        return object()


class FakeProducer:
    """Stores every record sent; `fail_from` makes records from that count on fail to store."""

    def __init__(self, fail_from: int | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.fail_from = fail_from
        self.stored_one = asyncio.Event()

    def create_batch(self) -> FakeBatch:
        return FakeBatch()

    async def send_batch(
        self, batch: FakeBatch, topic: str, *, partition: int
    ) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        for value in batch.values:
            if self.fail_from is not None and len(self.sent) >= self.fail_from:
                future.set_exception(TimeoutError("not stored"))
                return future
            self.sent.append(json.loads(value))
        self.stored_one.set()
        future.set_result(None)
        return future

    async def send(self, topic: str, value: bytes, **kwargs: Any) -> asyncio.Future[Any]:
        batch = FakeBatch()
        batch.values.append(value)
        return await self.send_batch(batch, topic, partition=0)

    def records(self) -> list[DeltaResult | DoneResult | ErrorResult]:
        out = []
        for value in self.sent:
            record = _records.validate_python(value)
            assert isinstance(record, DeltaResult | DoneResult | ErrorResult)
            out.append(record)
        return out


def request(prompt: str, max_tokens: int = 30) -> QueuedRequest:
    return QueuedRequest(
        request_id="r1",
        prompt=prompt,
        max_tokens=max_tokens,
        tier=Tier.interactive,
        prompt_tokens=1,
        reply_to=ReplyTo(topic="t.results", partition=0),
    )


def runner_of(
    engine: SimEngine,
    outbox: ResultOutbox,
    epoch_now: Callable[[], int] = lambda: 0,
    variant: str | None = None,
) -> RequestRunner:
    """The runner these tests run: a chunk per token, writes given up after 0.5 s."""
    return RequestRunner(
        engine,
        outbox,
        RunningRequests(engine),
        flush_ms=1.0,
        flush_tokens=1,
        telemetry=_telemetry(),
        epoch_now=epoch_now,
        write_timeout_s=0.5,
        model="m",
        variant=variant,
    )


async def run(
    prompt: str,
    producer: FakeProducer,
    *,
    context: int = 8192,
    epochs: list[int] | None = None,
    variant: str | None = None,
) -> tuple[str, SimEngine]:
    profile = sim_profile("constant", max_num_seqs=4, token_rate=500.0, context_length=context)
    engine = SimEngine(profile, fail_marker=MARKER)
    await engine.start()
    clock = iter(epochs) if epochs is not None else None
    try:
        async with ResultOutbox(producer, resend_s=0.5) as outbox:
            epoch_now = (lambda: next(clock, 1)) if clock is not None else (lambda: 0)
            runner = runner_of(engine, outbox, epoch_now, variant)
            outcome = await runner.run(request(prompt), 1, UNTRACED)
    finally:
        await engine.stop()
    return outcome, engine


async def test_an_engine_failure_is_answered_with_one_internal_error_after_its_deltas() -> None:
    producer = FakeProducer()
    outcome, _ = await run(f"tell me a story {MARKER}", producer)
    assert outcome == "answered"
    records = producer.records()
    deltas = [r for r in records if isinstance(r, DeltaResult)]
    finals = [r for r in records if not isinstance(r, DeltaResult)]
    assert len(finals) == 1
    assert records[-1] is finals[0]
    final = finals[0]
    assert isinstance(final, ErrorResult)
    assert final.code == "internal"
    assert final.seq == len(deltas) == 1  # the first token left, then the engine failed
    # What it made, for the edge to settle the tenant's charge with (issue 37, N5).
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (0, 1)


@pytest.mark.parametrize(
    ("attempt", "outcome"), [(0, "engine_dead"), (1, "engine_dead"), (2, "answered")]
)
async def test_a_request_on_an_engine_that_died_runs_again_elsewhere_a_bounded_number_of_times(
    tmp_path: Path, attempt: int, outcome: str
) -> None:
    """Issue 38, item 2: the engine died (not the request): it is left unanswered for the
    recovery to run elsewhere once the worker has exited, not answered `internal`; from its
    third attempt on it is answered, since a request that kills every engine it meets would
    take down each worker in turn."""
    fault = tmp_path / "fault"
    profile = sim_profile("constant", max_num_seqs=4, token_rate=200.0)
    engine = SimEngine(profile, fault_file=str(fault))
    producer = FakeProducer()
    await engine.start()
    try:
        async with ResultOutbox(producer, resend_s=0.5) as outbox:
            runner = runner_of(engine, outbox)
            queued = request("a long one", max_tokens=2000).model_copy(update={"attempt": attempt})
            strike(fault, "dead")
            got = await asyncio.wait_for(runner.run(queued, 1, UNTRACED), 10)
    finally:
        await engine.stop()
    assert got == outcome
    finals = [r for r in producer.records() if not isinstance(r, DeltaResult)]
    if outcome == "engine_dead":
        assert finals == []  # nothing final written: the next attempt answers
    else:
        [final] = finals
        assert isinstance(final, ErrorResult)
        assert final.code == "internal"


async def test_a_prompt_over_the_context_is_refused_before_the_engine_runs_it() -> None:
    producer = FakeProducer()
    outcome, engine = await run("word " * 40, producer, context=32)
    assert outcome == "answered"
    [final] = producer.records()
    assert isinstance(final, ErrorResult)
    assert final.code == "invalid_request"
    assert "40 tokens" in final.message
    assert "context length of 32 tokens" in final.message
    assert engine.steps == 0  # the engine never ran a step for it


async def test_a_prompt_of_the_whole_context_is_refused_one_token_less_runs_to_its_end() -> None:
    # As vLLM 0.32 counts it: a prompt must leave room for one output token (ADR 0051).
    producer = FakeProducer()
    outcome, _ = await run("word " * 32, producer, context=32)
    assert outcome == "answered"
    [final] = producer.records()
    assert isinstance(final, ErrorResult)
    assert final.code == "invalid_request"
    assert "no room for an output token" in final.message
    producer = FakeProducer()
    outcome, _ = await run("word " * 31, producer, context=32)
    assert outcome == "answered"
    done = producer.records()[-1]
    assert isinstance(done, DoneResult)
    # max_tokens 30 asked, but the answer stops at the end of the context.
    assert (done.finish_reason, done.usage.completion_tokens) == ("length", 1)


async def test_a_result_that_cannot_be_stored_stops_the_run_for_a_rerun_without_a_final() -> None:
    prompt = "a long enough answer please"
    assert complete(prompt, 30).completion_tokens > 3
    producer = FakeProducer(fail_from=2)
    outcome, _ = await run(prompt, producer)
    assert outcome == "rerun"
    assert all(isinstance(r, DeltaResult) for r in producer.records())


async def test_a_run_fenced_midway_writes_nothing_more() -> None:
    prompt = "a long enough answer please"
    producer = FakeProducer()
    # Epoch 0 for the start and the first two writes, then the worker fences itself.
    outcome, _ = await run(prompt, producer, epochs=[0, 0, 0])
    assert outcome == "rerun"
    records = producer.records()
    assert len(records) == 2
    assert all(isinstance(r, DeltaResult) for r in records)


async def test_a_later_attempt_of_a_request_running_here_supersedes_it_silently() -> None:
    profile = sim_profile("constant", max_num_seqs=4, token_rate=200.0)
    engine = SimEngine(profile)
    await engine.start()
    producer = FakeProducer()
    first = request("a long enough answer please", max_tokens=200)
    again = first.next_attempt()
    try:
        async with ResultOutbox(producer, resend_s=0.5) as outbox:
            runner = runner_of(engine, outbox)
            old = asyncio.create_task(runner.run(first, 1, UNTRACED))
            await producer.stored_one.wait()  # the old attempt is streaming
            outcome = await runner.run(again, 1, UNTRACED)
            assert await old == "superseded"
            assert outcome == "answered"
            # An attempt older than the one running is not run at all.
            late = asyncio.create_task(runner.run(again, 1, UNTRACED))
            assert await runner.run(first, 1, UNTRACED) == "superseded"
            await late
    finally:
        await engine.stop()
    records = producer.records()
    finals = [r for r in records if not isinstance(r, DeltaResult)]
    assert [(f.attempt, f.kind) for f in finals] == [(1, "done"), (1, "done")]


async def test_logprobs_reach_the_records_in_order_a_chunk_without_text_included() -> None:
    """A token that is half a character has no text yet: its chunk still carries its
    logprob (dropped with the empty text, the answer would have fewer logprobs than tokens)."""
    producer = FakeProducer()
    logprobs = [TokenLogprob(token=t, logprob=-1.0) for t in ("\ufffd", "é", "!")]

    async def outputs() -> AsyncIterator[EngineOutput]:
        yield EngineDelta("", 1, (logprobs[0],))
        yield EngineDelta("é", 1, (logprobs[1],))
        yield EngineDelta("!", 1, (logprobs[2],))
        yield EngineFinish("length", 1, 3)

    profile = sim_profile("constant", max_num_seqs=4, token_rate=500.0)
    engine = SimEngine(profile)
    async with ResultOutbox(producer, resend_s=0.5) as outbox:
        runner = runner_of(engine, outbox)
        outcome = await runner.run(request("x"), 1, UNTRACED, stream=outputs())
    assert outcome == "answered"
    deltas = [r for r in producer.records() if isinstance(r, DeltaResult)]
    assert [d.text for d in deltas] == ["", "é", "!"]
    assert [t for d in deltas for t in d.logprobs or ()] == logprobs


async def test_the_done_record_names_the_workers_variant_and_leaves_the_baselines_out() -> None:
    canary, baseline = FakeProducer(), FakeProducer()
    await run("which variant?", canary, variant="canary")
    await run("which variant?", baseline)
    [done] = [r for r in canary.records() if isinstance(r, DoneResult)]
    assert (done.model, done.variant) == ("m", "canary")
    # The baseline's record has no `variant` key: readers from before variants still read it.
    [value] = [v for v in baseline.sent if v["kind"] == "done"]
    assert value["model"] == "m"
    assert "variant" not in value


class UnstoringProducer(FakeProducer):
    """A producer whose records are never stored: their leader's node is away."""

    async def send_batch(
        self, batch: FakeBatch, topic: str, *, partition: int
    ) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().create_future()  # never resolved


async def test_a_run_whose_engine_is_done_is_not_held_while_its_records_wait_to_be_stored() -> None:
    """A chaos check's black-holed node held the finals of a worker's runs, and its engine
    watch (engine_health.py) took the idle engine for hung and ended the worker."""
    profile = sim_profile("constant", max_num_seqs=4, token_rate=500.0)
    engine = SimEngine(profile)
    await engine.start()
    try:
        async with ResultOutbox(UnstoringProducer(), resend_s=30.0) as outbox:
            runs = RunningRequests(engine)
            runner = RequestRunner(
                engine,
                outbox,
                runs,
                flush_ms=1.0,
                flush_tokens=1,
                telemetry=_telemetry(),
                epoch_now=lambda: 0,
                write_timeout_s=30.0,
                model="m",
            )
            task = asyncio.create_task(runner.run(request("short", max_tokens=4), 1, UNTRACED))
            deadline = asyncio.get_running_loop().time() + 5.0
            while runs.progress()[0] or not runs.get("r1"):
                assert asyncio.get_running_loop().time() < deadline, runs.progress()
                await asyncio.sleep(0.01)
            assert not task.done()  # its final still waits to be stored
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        await engine.stop()
