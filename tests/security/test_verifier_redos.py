"""Issue 37, N9 and N7: text a tenant steers, judged by a route's verifiers or read as tool-call
arguments, can neither stall the worker nor end a run without its final.

Before: a route's `regex` verifier ran Python's `re.search` on the worker's event loop, so an
answer that made the operator's pattern backtrack catastrophically blocked heartbeats (the
worker was declared dead, and the same answer blocked the next one); JSON nested past the
parser's depth raised `RecursionError`, which escaped `except ValueError` in the json_schema
verifier and in the tool-call readers (`services/worker/engines/structured.py`).

Each test here is the attack on the worker's own code, in this process: the verifiers are
pure, and the event loop they must not block is the one the test runs.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
from pydantic import ValidationError

from services.worker.cascade import Cascade
from services.worker.engines.base import ChatTurn, EngineFinish, EngineRequest
from services.worker.engines.structured import NO_CALLS, guided_calls, template_messages
from services.worker.verifiers import REGEX_TIMEOUT_S, Answer, failing
from shared.cascades import RegexVerifier, Route
from shared.messages import FunctionCall, NamedToolChoice, QueuedRequest, ReplyTo, Tier, ToolCall
from shared.settings import TokenbusSettings
from shared.topics import Topics

# Backtracks exponentially in Python's `re` on a run of a's that does not end the match.
RE_BOMB = r"^(a+)+$"
# And in the `regex` package, which the verifier uses now: its timeout has to stop it.
REGEX_BOMB = r"^(a|aa)+$"
STEERED = "a" * 60 + "!"  # an answer the tenant asked for: "repeat 'a' sixty times, then !"
DEEP = "[" * 5000 + "]" * 5000  # JSON nested past the parser's depth


def route(*verifiers: dict[str, Any]) -> dict[str, Route]:
    return TokenbusSettings(
        routes={"auto": {"cascade": ["small", "large"], "verifiers": list(verifiers)}}
    ).routes


def state_of(text: str) -> Any:
    request = QueuedRequest(
        request_id="r1",
        prompt="repeat a",
        model="auto",
        tier=Tier.interactive,
        prompt_tokens=3,
        reply_to=ReplyTo(topic="tb.results", partition=0),
        cascade_step=0,
    )
    return SimpleNamespace(
        request=request, request_id="r1", keep_answer=True, chunks=[text], logprobs=[]
    )


@pytest.mark.parametrize(
    "pattern", [RE_BOMB, r"(\w*\s?)*$", r"(x{1,9})+y", r"((?:ab)+c?)*", r"(?=(a+)+$)"]
)
def test_a_pattern_that_repeats_a_repeat_is_refused_where_the_routes_are_read(
    pattern: str,
) -> None:
    """N9, "nested quantifiers refused at config load": before, `(a+)+` was accepted and
    only the search's timeout stood between it and a tenant's steered answer."""
    with pytest.raises(ValidationError, match=r"holds a repeat of its own.*possessive"):
        route({"kind": "regex", "pattern": pattern})


@pytest.mark.parametrize(
    "pattern", [r"^\d{4}-\d{2}-\d{2}$", r"(ab?)+", r"(a{3})+", r"(?>a+)+", r"(\d++,)*", "^(a|aa)+$"]
)
def test_patterns_without_a_variable_repeat_under_a_repeat_are_kept(pattern: str) -> None:
    assert route({"kind": "regex", "pattern": pattern})["auto"].verifiers


@pytest.mark.timeout(30)  # before: Python's re on the same call ran for hours
@pytest.mark.parametrize("pattern", [RE_BOMB, REGEX_BOMB], ids=["re_bomb", "regex_bomb"])
def test_a_catastrophic_pattern_fails_the_answer_within_its_timeout(pattern: str) -> None:
    """The second guard: the search's timeout, for what the load check lets through (the
    overlapping alternatives of REGEX_BOMB) and, built past the check, for `(a+)+` itself."""
    started = time.monotonic()
    verifier = RegexVerifier.model_construct(kind="regex", pattern=pattern)
    reason = failing([verifier], Answer(STEERED, 61))
    assert reason == "regex"  # not shown to match: the next model answers
    assert time.monotonic() - started < 4 * REGEX_TIMEOUT_S + 1


@pytest.mark.timeout(30)
async def test_the_worker_loop_runs_on_while_an_answer_is_judged() -> None:
    """The judgement runs in a thread that releases the GIL: a coroutine ticking every 10 ms
    (as the worker's heartbeat and its other runs do) keeps its pace meanwhile."""
    cascade = Cascade(
        route({"kind": "regex", "pattern": REGEX_BOMB}),
        Topics("t"),
        cast(Any, None),
        lambda: 0,
        1.0,
    )
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    try:
        await asyncio.sleep(0.05)
        started = time.monotonic()
        finish = EngineFinish(finish_reason="stop", prompt_tokens=3, completion_tokens=61)
        up = await cascade.decide(state_of(STEERED), finish)
        took = time.monotonic() - started
    finally:
        ticker.cancel()
    assert up is not None
    assert (up.reason, up.to_model) == ("regex", "large")
    assert took >= REGEX_TIMEOUT_S * 0.9  # it did search until its timeout
    during = [t for t in ticks if started <= t <= started + took]
    gaps = [b - a for a, b in itertools.pairwise(during)]
    assert len(during) >= took / 0.01 * 0.3, (len(during), took)
    assert max(gaps, default=0.0) < 0.25, max(gaps)


def test_json_nested_past_the_parsers_depth_fails_the_schema_verifier() -> None:
    verifiers = route({"kind": "json_schema", "schema": {"type": "array"}})["auto"].verifiers
    assert failing(verifiers, Answer(DEEP, 100)) == "json_schema"
    assert failing(verifiers, Answer("[[1], [2]]", 8)) is None


def test_tool_call_arguments_nested_past_the_parsers_depth_are_read_as_nothing() -> None:
    """N7: a tenant's conversation carrying 2,000-deep tool-call arguments (its own earlier
    turn, as it claims it) raised RecursionError where the worker templates it, failing the
    run; a guided answer that deep read the same way. Both read as no arguments now."""
    call = ToolCall(id="call_1", function=FunctionCall(name="f", arguments=DEEP))
    turns = (
        ChatTurn("user", "weather?"),
        ChatTurn("assistant", "", tool_calls=(call,)),
        ChatTurn("tool", "sunny", tool_call_id="call_1"),
    )
    [_, said, _] = template_messages(turns)
    assert said["tool_calls"][0]["function"]["arguments"] == {}
    request = EngineRequest(
        "r1",
        "q",
        8,
        messages=turns,
        tool_choice=NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}}),
    )
    assert guided_calls(request, DEEP) == NO_CALLS
