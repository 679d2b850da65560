"""Cascades on a real stack (ADR 0059): a route `auto` = [small, large] with the refusal
verifier; the small sim worker declines a share of prompts (by a hash of the prompt).

A cascade escalates exactly the failing answers: the requests whose prompt the small
worker declines show its stream, a `reset`, and the large model's answer, and end once,
on `large`; every other one ends on `small` with no reset. A run the small model's engine
fails (a marker in the prompt makes the sim fail after its first token) goes on to `large`
as well, instead of ending in an error. The OpenAI API answers with
the model that answered, whole or streamed. Routing rules start a request on `large`
by its prompt's length or its key's plan.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from services.edge import keys as keyfile
from services.worker.engines.sim_refusals import REFUSAL_TEXT, refuses
from services.worker.engines.sim_text import complete
from shared.messages import ChatMessage, ChatRequest
from tests.chat_client import ChatSession, Transcript, openai_sdk, run_requests, served_models
from tests.stack import UNLIMITED, Stack, new_prefix, wait_until
from tests.worker_logs import reruns

SMALL, LARGE, ROUTE = "small", "large", "auto"
REFUSE_SHARE = 0.3
LONG_PROMPT_TOKENS = 600  # a prompt's token bound at least this: straight to `large`
PLAN = "pro"
ROUTES = {
    ROUTE: {
        "cascade": [SMALL, LARGE],
        "verifiers": [{"kind": "refusal"}],
        "rules": [
            {"start": LARGE, "min_prompt_tokens": LONG_PROMPT_TOKENS},
            {"start": LARGE, "plans": [PLAN]},
        ],
    }
}
MAX_TOKENS = 12
# The kill test's: 40 tokens at the slow small worker's 25 a second, 1.6 s a stream, so that
# the kill lands while the worker still writes the streams the client saw begin (12 tokens,
# 0.5 s, were often all written by then on a loaded machine: nothing was run again).
KILL_MAX_TOKENS = 40
ENGINE_BREAKS = "engine-breaks-here"  # the small worker's engine fails such a prompt


@pytest.fixture(scope="module")
def cascade(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={"TOKENBUS_ROUTES": json.dumps(ROUTES)},
        workers={
            "worker-small": {
                "TOKENBUS_WORKER_ID": "worker-small",
                "TOKENBUS_WORKER_MODEL": SMALL,
                "TOKENBUS_WORKER_SIM_REFUSE_SHARE": str(REFUSE_SHARE),
                "TOKENBUS_WORKER_SIM_FAIL_MARKER": ENGINE_BREAKS,
            },
            "worker-large": {"TOKENBUS_WORKER_ID": "worker-large", "TOKENBUS_WORKER_MODEL": LARGE},
        },
    )
    # A key with a plan, in the stack's keys file (the edge reads it again on change).
    keys, stack.keys[PLAN], _ = keyfile.add_key(
        keyfile.load(stack.keys_file), "paying", UNLIMITED, time.time(), plan=PLAN
    )
    keyfile.save(stack.keys_file, keys)
    try:
        stack.start()
        wait_until(
            lambda: {ROUTE, SMALL, LARGE} <= set(served_models(stack)), 60, "the route listed"
        )
        yield stack
    finally:
        stack.stop()


def prompts(n: int, tag: str) -> list[str]:
    return [f"{tag} {i}: why do buses wait?" for i in range(n)]


def ask(prompt: str, client_id: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"client_id": client_id, "prompt": prompt, "model": ROUTE, "max_tokens": max_tokens}


def attempts(t: Transcript) -> list[list[dict[str, Any]]]:
    """The transcript's frames split at each `chat.reset`."""
    out: list[list[dict[str, Any]]] = [[]]
    for frame in t.frames:
        if frame["type"] == "chat.reset":
            out.append([])
        else:
            out[-1].append(frame)
    return out


def text_of(frames: list[dict[str, Any]]) -> str:
    return "".join(f["text"] for f in frames if f["type"] == "chat.delta")


def escalations(stack: Stack, reason: str = "refusal") -> float:
    for line in stack.metrics("worker-small").splitlines():
        if line.startswith("tokenbus_worker_cascade_escalations_total{"):
            assert f'route="{ROUTE}"' in line
            assert f'from_model="{SMALL}"' in line
            if f'reason="{reason}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def finals_per_request(stack: Stack) -> Counter[str]:
    records = [json.loads(v) for v in await stack.read_async(stack.topics.results)]
    return Counter(r["request_id"] for r in records if r.get("kind") in ("done", "error"))


async def test_a_cascade_escalates_exactly_the_answers_the_small_model_declines(
    cascade: Stack,
) -> None:
    sent = prompts(40, "ws")
    expected = {p for p in sent if refuses(p, REFUSE_SHARE)}
    assert 3 <= len(expected) <= 30  # the test has both kinds to look at
    before = escalations(cascade)
    async with websockets.connect(cascade.ws_url) as ws:
        results = await run_requests(ws, [ask(p, f"c{i}") for i, p in enumerate(sent)], timeout=120)
    escalated = set()
    for i, prompt in enumerate(sent):
        t = results[f"c{i}"]
        assert t.final is not None, t.frames
        assert t.final["type"] == "chat.done", t.final
        answer = complete(prompt, MAX_TOKENS).text
        if t.resets:
            escalated.add(prompt)
            assert t.resets == [1], t.frames
            small, large = attempts(t)
            assert REFUSAL_TEXT.startswith(text_of(small)), small  # the small stream, live
            assert text_of(large) == answer
            assert t.final["model"] == LARGE
        else:
            assert text_of(t.frames) == answer
            assert t.final["model"] == SMALL
    assert escalated == expected
    # Each request ended once on the log too: one final record each, none for attempt 0 of
    # the escalated ones.
    ids = {results[f"c{i}"].request_id for i in range(len(sent))}
    finals = await finals_per_request(cascade)
    assert {rid: finals[rid] for rid in ids} == dict.fromkeys(ids, 1)
    wait_until(
        lambda: escalations(cascade) - before == len(expected), 10, "the escalations counted"
    )
    # Each escalation's reset carries what the declined answer used, for the edge to charge
    # beside the final's (issue 37, N5: a cascade settled only its last attempt).
    declined = {
        results[f"c{i}"].request_id: sum(
            f["type"] == "chat.delta" for f in attempts(results[f"c{i}"])[0]
        )
        for i, p in enumerate(sent)
        if p in expected
    }
    records = [json.loads(v) for v in await cascade.read_async(cascade.topics.results)]
    resets = {r["request_id"]: r for r in records if r.get("kind") == "reset"}
    for rid, deltas in declined.items():
        usage = resets[rid].get("usage")
        assert usage is not None, resets[rid]
        assert usage["completion_tokens"] >= deltas >= 1, (usage, deltas)
        assert usage["prompt_tokens"] > 0, usage


async def test_a_run_the_small_models_engine_fails_goes_on_to_the_large_model(
    cascade: Stack,
) -> None:
    sent = [f"{p} {ENGINE_BREAKS}" for p in prompts(4, "broken")]
    before = escalations(cascade, "engine_error")
    async with websockets.connect(cascade.ws_url) as ws:
        results = await run_requests(ws, [ask(p, f"e{i}") for i, p in enumerate(sent)], timeout=60)
    for i, prompt in enumerate(sent):
        t = results[f"e{i}"]
        assert t.final is not None, t.frames
        assert t.final["type"] == "chat.done", t.frames  # no `internal` error shown
        # The small engine's first token, then its failure. The sims share their text, so
        # the large model's answer begins with what was shown, and the edge shows it going
        # on (ADR 0071): no reset. Not so where the small one had begun a refusal.
        assert t.resets == ([1] if refuses(prompt, REFUSE_SHARE) else []), t.frames
        assert text_of(t.final_attempt) == complete(prompt, MAX_TOKENS).text
        assert t.final["model"] == LARGE
    ids = {results[f"e{i}"].request_id for i in range(len(sent))}
    finals = await finals_per_request(cascade)
    assert {rid: finals[rid] for rid in ids} == dict.fromkeys(ids, 1)
    wait_until(
        lambda: escalations(cascade, "engine_error") - before == len(sent),
        10,
        "the escalations counted",
    )


def test_the_openai_api_answers_with_the_model_that_answered_whole_or_streamed(
    cascade: Stack,
) -> None:
    sdk = openai_sdk(cascade)
    sent = prompts(12, "api")
    for i, prompt in enumerate(sent):
        declined = refuses(f"user: {prompt}", REFUSE_SHARE)
        messages = [{"role": "user", "content": prompt}]
        expected = ChatRequest(messages=[ChatMessage(role="user", content=prompt)])
        answer = complete(expected.prompt_text(), MAX_TOKENS).text
        want_model = LARGE if declined else SMALL
        if i % 2:
            whole = sdk.chat.completions.create(
                model=ROUTE,
                messages=messages,
                max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
            )
            assert whole.model == want_model
            assert whole.choices[0].message.content == answer
            continue
        stream = sdk.chat.completions.create(
            model=ROUTE,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            stream=True,
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == answer  # never the declined answer: a route's text comes whole
        assert chunks[-1].model == want_model
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert any(refuses(f"user: {p}", REFUSE_SHARE) for p in sent)  # both kinds were asked
    assert not all(refuses(f"user: {p}", REFUSE_SHARE) for p in sent)


async def test_rules_start_long_prompts_and_a_plans_requests_on_the_large_model(
    cascade: Stack,
) -> None:
    declined = [p for p in prompts(60, "rule") if refuses(p, REFUSE_SHARE)][:3]
    plain = [p for p in prompts(60, "rule") if not refuses(p, REFUSE_SHARE)][:3]
    long_prompt = "why do buses wait? " * (LONG_PROMPT_TOKENS // 19 + 1)
    assert ChatRequest(prompt=long_prompt).prompt_token_bound() >= LONG_PROMPT_TOKENS
    async with websockets.connect(cascade.ws_url_as(PLAN)) as ws:
        paying = await run_requests(ws, [ask(p, f"p{i}") for i, p in enumerate(declined + plain)])
    async with websockets.connect(cascade.ws_url) as ws:
        long = await run_requests(ws, [ask(long_prompt, "long")])
    for t in [*paying.values(), *long.values()]:
        assert t.final is not None, t.frames
        assert (t.final["type"], t.final["model"]) == ("chat.done", LARGE), t.final
        assert t.resets == []  # started on `large`: nothing to escalate
    # Without the plan, the same declined prompts escalate: the plan made the difference.
    async with websockets.connect(cascade.ws_url) as ws:
        free = await run_requests(ws, [ask(p, f"f{i}") for i, p in enumerate(declined)])
    assert all(t.resets == [1] for t in free.values())


@pytest.fixture(scope="module")
def slow_small(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    """A cascade whose small worker is slow enough to be killed with requests in flight."""
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={"TOKENBUS_ROUTES": json.dumps(ROUTES)},
        workers={
            "worker-small": {
                "TOKENBUS_WORKER_ID": "worker-small",
                "TOKENBUS_WORKER_MODEL": SMALL,
                "TOKENBUS_WORKER_SIM_REFUSE_SHARE": str(REFUSE_SHARE),
                "TOKENBUS_WORKER_SIM_TOKEN_RATE": "25",
                "TOKENBUS_WORKER_MAX_NUM_SEQS": "8",
            },
            "worker-large": {"TOKENBUS_WORKER_ID": "worker-large", "TOKENBUS_WORKER_MODEL": LARGE},
        },
    )
    try:
        stack.start()
        wait_until(
            lambda: {ROUTE, SMALL, LARGE} <= set(served_models(stack)), 60, "the route listed"
        )
        yield stack
    finally:
        stack.stop()


async def test_no_request_is_lost_or_answered_twice_when_the_small_worker_is_killed(
    slow_small: Stack,
) -> None:
    stack = slow_small
    sent = prompts(40, "kill")
    async with websockets.connect(stack.ws_url) as ws:
        session = ChatSession(ws)
        for i, prompt in enumerate(sent):
            await session.send(ask(prompt, f"k{i}", KILL_MAX_TOKENS))

        # Killed in the middle of streams, of escalations, of batches not yet committed:
        # once some have ended and one is streaming its first attempt (on `small`).
        def streaming_on_small() -> bool:
            return len(session.ended) >= 6 and any(
                t.deltas and not t.resets and t.final is None for t in session.by_client.values()
            )

        await session.until(streaming_on_small, within=60)
        stack.stop_service("worker-small", signal.SIGKILL)
        stack.start_service("worker", "worker-small", **stack.workers["worker-small"])
        await session.until(session.all_ended, within=180)
    for i, prompt in enumerate(sent):
        t = session.by_client[f"k{i}"]
        assert t.final is not None, t.frames
        assert t.final["type"] == "chat.done", t.final
        # Declined prompts end on `large` (escalated, perhaps after a re-run on `small`);
        # the others on `small` (perhaps re-run there), with its whole answer.
        want = LARGE if refuses(prompt, REFUSE_SHARE) else SMALL
        assert t.final["model"] == want, t.frames
        assert text_of(t.final_attempt) == complete(prompt, KILL_MAX_TOKENS).text
    # The kill hit requests in flight: some were run again, continuing what the killed
    # worker had sent (ADR 0071): the client saw no reset a verifier did not cause.
    declined = {f"k{i}" for i, p in enumerate(sent) if refuses(p, REFUSE_SHARE)}
    ids = {session.by_client[f"k{i}"].request_id for i in range(len(sent))}
    rerun = reruns([stack.log("worker-small")]) & ids  # its restarted process logs there too
    assert rerun, "the kill hit no request in flight: the test proved nothing"
    for client, t in session.by_client.items():
        assert len(t.resets) == (client in declined), t.frames
    finals = await finals_per_request(stack)
    assert {rid: finals[rid] for rid in ids} == dict.fromkeys(ids, 1)
