"""A lost attempt's next one continues the answer where it stood (ADR 0071): the worker side.

The sim is exact: for greedy (and seeded) requests the answer continued after any chunk is
the uninterrupted answer to the character, with the same usage; the runner writes the text
so far as the continuing attempt's first delta, and a run stopped for a rerun leaves what it
sent for the next attempt; the recovery's read-back takes an attempt's text from its deltas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.cascade import onwards
from services.worker.drain import Drain
from services.worker.engines.base import EngineDelta, EngineFinish, EngineRequest
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_profiles import sim_profile
from services.worker.engines.vllm import continued_ids, rest_of
from services.worker.outbox import ResultOutbox
from shared import finals
from shared.messages import DeltaResult, DoneResult
from shared.tokens import sim_tokens
from tests.test_cascades import AUTO, queued, routes
from tests.test_worker_runner import UNTRACED, FakeProducer, request, runner_of

PROMPT = "tell me about the bus and its passengers"


async def generate(engine: SimEngine, req: EngineRequest) -> tuple[str, EngineFinish]:
    text: list[str] = []
    async for out in engine.generate(req):
        if isinstance(out, EngineDelta):
            text.append(out.text)
        else:
            return "".join(text), out
    raise AssertionError("no finish")


def sim() -> SimEngine:
    return SimEngine(sim_profile("constant", max_num_seqs=8, token_rate=5000.0))


@pytest.mark.parametrize("max_tokens", [12, 200])
@pytest.mark.parametrize("seed", [None, 7])
async def test_the_sim_continues_any_cut_of_its_answer_to_the_uninterrupted_one(
    max_tokens: int, seed: int | None
) -> None:
    engine = sim()
    await engine.start()
    try:
        base = EngineRequest("r1", PROMPT, max_tokens, temperature=0.0, seed=seed)
        whole, finish = await generate(engine, base)
        pieces: list[str] = []
        async for out in engine.generate(base):
            if isinstance(out, EngineDelta):
                pieces.append(out.text)
        for cut in range(len(pieces) + 1):
            said = "".join(pieces[:cut])
            rest, ended = await generate(engine, dataclasses.replace(base, continues=said))
            assert said + rest == whole, cut
            assert ended == finish, cut  # the same usage and finish: no token counted twice
    finally:
        await engine.stop()
    assert finish.completion_tokens <= max_tokens


async def test_a_continuation_the_sim_did_not_write_counts_its_tokens_within_max_tokens() -> None:
    engine = sim()
    await engine.start()
    try:
        said = "an answer some other sample wrote"
        req = EngineRequest("r1", PROMPT, 10, continues=said)
        rest, finish = await generate(engine, req)
        assert rest  # it goes on
        assert finish.completion_tokens <= 10
        assert finish.completion_tokens >= sim_tokens(said)
        spent = EngineRequest("r2", PROMPT, 3, continues=said)
        rest, finish = await generate(engine, spent)
        assert (rest, finish.finish_reason, finish.completion_tokens) == ("", "length", 6)
    finally:
        await engine.stop()


async def test_a_run_stopped_for_a_rerun_leaves_its_text_and_the_next_attempt_continues_it() -> (
    None
):
    engine = sim()
    await engine.start()
    try:
        whole_producer = FakeProducer()
        async with ResultOutbox(whole_producer, resend_s=0.5) as outbox:
            assert await runner_of(engine, outbox).run(request(PROMPT), 1, UNTRACED) == "answered"
        whole = whole_producer.records()
        # The same request, its writes failing after the third record: stopped for a rerun.
        lost = FakeProducer(fail_from=3)
        async with ResultOutbox(lost, resend_s=0.5) as outbox:
            runner = runner_of(engine, outbox)
            first = request(PROMPT)
            assert await runner.run(first, 1, UNTRACED) == "rerun"
            sent = runner.left_text(first)
            assert runner.left_text(first) is None  # handed over once
        assert sent
        again = first.next_attempt(sent)
        assert (again.attempt, again.continues) == (1, sent)
        producer = FakeProducer()
        async with ResultOutbox(producer, resend_s=0.5) as outbox:
            assert await runner_of(engine, outbox).run(again, 1, UNTRACED) == "answered"
    finally:
        await engine.stop()
    records = producer.records()
    deltas = [r for r in records if isinstance(r, DeltaResult)]
    assert deltas[0].text == sent  # the text so far first: a reader that starts over has it
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    text = "".join(d.text for d in deltas)
    assert text == "".join(r.text for r in whole if isinstance(r, DeltaResult))
    [done] = [r for r in records if isinstance(r, DoneResult)]
    [whole_done] = [r for r in whole if isinstance(r, DoneResult)]
    assert done.attempt == 1
    assert done.usage == whole_done.usage  # each token counted once over the attempts


def test_the_next_attempt_continues_what_it_was_given_when_its_run_sent_nothing() -> None:
    first = request(PROMPT).next_attempt("The bus")
    assert first.next_attempt().continues == "The bus"
    assert first.next_attempt("").continues == "The bus"
    assert first.next_attempt("The bus leaves").continues == "The bus leaves"
    assert "continues" not in json.loads(request(PROMPT).model_dump_json())


def test_a_cascades_next_model_starts_the_answer_over() -> None:
    ran = queued(step=0, continues="I'm sorry, but")
    up = onwards(routes(auto=AUTO), ran, "refusal")
    assert up is not None
    assert (up.next_attempt.cascade_step, up.next_attempt.continues) == (1, None)


def result(seq: int, text: str = "", *, attempt: int = 0, kind: str = "delta") -> bytes:
    body: dict[str, object] = {"request_id": "r1", "attempt": attempt, "seq": seq, "kind": kind}
    if kind == "delta":
        body["text"] = text
    return json.dumps(body).encode()


def test_the_read_back_takes_the_attempts_deltas_in_order_up_to_a_hole() -> None:
    attempts = {"r1": finals._Attempt(1)}
    answered: set[str] = set()
    for value in [
        result(0, "old", attempt=0),  # an earlier attempt's: not this one's text
        result(1, " b", attempt=1),
        result(0, "a", attempt=1),
        result(1, " b again", attempt=1),  # a duplicate: the first read counts
        result(3, " d", attempt=1),  # after a hole: not taken
        result(0, kind="reset", attempt=2),
        b"not json",
    ]:
        finals._observe(value, attempts, answered)
    assert attempts["r1"].text() == "a b"
    assert answered == set()
    finals._observe(result(2, kind="done", attempt=1), attempts, answered)
    assert answered == {"r1"}


class WordTokenizer:
    """A fake tokenizer: one id per word."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert not add_special_tokens
        return [len(w) for w in text.split()]


@given(st.integers(1, 50), st.integers(0, 40), st.one_of(st.none(), st.integers(0, 60)))
@settings(max_examples=50)
def test_vllm_samples_the_rest_of_max_tokens_and_min_tokens(
    max_tokens: int, said: int, min_tokens: int | None
) -> None:
    req = EngineRequest("r1", PROMPT, max_tokens, min_tokens=min_tokens)
    rest = rest_of(req, said)
    assert rest.max_tokens == max_tokens - said
    if said == 0:
        assert rest is req
    elif min_tokens is not None:
        assert rest.min_tokens == max(0, min_tokens - said)
    assert rest_of(dataclasses.replace(req, max_tokens=None), said).max_tokens is None
    words = " ".join(["w"] * said)
    assert len(continued_ids(WordTokenizer(), dataclasses.replace(req, continues=words))) == said
    assert continued_ids(WordTokenizer(), req) == []


async def test_a_drain_hands_back_at_once_what_can_be_continued_and_waits_for_the_rest() -> None:
    drain = Drain(timeout_s=0.3)
    running = {"free-text", "with-tools"}
    stopped: list[tuple[str, float]] = []
    began = asyncio.get_running_loop().time()
    all_stopped = asyncio.Event()

    async def stop(request_id: str) -> bool:
        stopped.append((request_id, asyncio.get_running_loop().time() - began))
        running.discard(request_id)
        if not running:
            all_stopped.set()
        return True

    task = asyncio.create_task(all_stopped.wait())  # the batch: ends once both are stopped
    await drain.run({task}, lambda: frozenset(running), stop, at_once=lambda r: r == "free-text")
    assert [r for r, _ in stopped] == ["free-text", "with-tools"]
    assert stopped[0][1] < 0.1  # at once
    assert stopped[1][1] >= 0.3  # after the drain window
