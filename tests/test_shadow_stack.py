"""Shadow validation on a real stack (ADR 0057): scores tell a faithful variant from an
unfaithful one, and the users' answers are untouched.

One model with three sim workers: the baseline (the gold), a faithful variant `good`, and an
unfaithful variant `bad` that answers half its prompts wrongly
(`TOKENBUS_WORKER_SIM_WRONG_SHARE`). Shadow validation is turned on with the real
`tokenbus models shadow` command, at 100 % with gold = baseline; the variants share the
traffic. Greedy requests over the WebSocket: each ends exactly once, as its variant
answers it. Every answer of `good` and `bad` is run again on the baseline and scored: the
scores on the scores topic say `good` agrees exactly every time and `bad` exactly where its
wrong share does not strike (known per prompt from the same hash), and the scheduler's
quality metrics count them per variant. The baseline's own answers are not scored.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from services.worker.engines.sim_text import complete
from services.worker.engines.sim_wrong import answers_wrong
from shared.shadows import ShadowScore
from tests.chat_client import run_requests
from tests.shadow_stack import (
    BAD,
    GOOD,
    MODEL,
    WRONG_SHARE,
    roll_out,
    scheduler_metric,
)
from tests.shadow_stack import shadow_stack as started
from tests.stack import Stack, wait_until

pytestmark = pytest.mark.kafka

REQUESTS = 60
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def shadow_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    with started(bootstrap, log_dir) as stack:
        yield stack


def models(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    """`tokenbus models ARGS`, run as an operator would, against the stack's broker."""
    return stack.tokenbus("models", *args)


def request(i: int) -> dict[str, Any]:
    return {
        "client_id": f"c{i}",
        "conversation_id": f"conversation-{i}",  # spread over the variants by the rollout
        "prompt": f"shadow question {i}: what does the bus do?",
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


def faithful(prompt: str) -> str:
    return complete(prompt, MAX_TOKENS, temperature=0.0, top_p=None).text


def quality_count(stack: Stack, variant: str) -> float | None:
    return scheduler_metric(stack, "tokenbus_scheduler_shadow_quality_count", variant)


def counts(stack: Stack, variant: str, n: int) -> Callable[[], bool]:
    """Whether the scheduler has counted `n` quality scores of `variant`."""
    return lambda: quality_count(stack, variant) == n


def read_scores(stack: Stack) -> list[ShadowScore]:
    return [ShadowScore.model_validate_json(v) for v in stack.read(stack.topics.scores)]


async def test_shadow_scores_tell_a_faithful_variant_from_an_unfaithful_one(
    shadow_stack: Stack,
) -> None:
    stack = shadow_stack
    done = models(stack, "shadow", MODEL, "--gold", "baseline", "--percent", "100")
    assert done.returncode == 0, done.stderr
    assert "shadow: 100 % of requests not on baseline also run on it" in done.stdout
    status = models(stack, "status", MODEL, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)[0]["shadow"] == {"gold": "baseline", "percent": 100.0}
    await roll_out(stack)

    requests = [request(i) for i in range(REQUESTS)]
    async with websockets.connect(stack.ws_url) as ws:
        transcripts = await run_requests(ws, requests, timeout=120)

    # The users' answers: each ended exactly once, with its variant's own answer.
    by_request: dict[str, tuple[str, str]] = {}  # request id -> (variant, prompt)
    for r in requests:
        t = transcripts[r["client_id"]]
        finals = [f for f in t.frames if f["type"] in ("chat.done", "error")]
        assert len(finals) == 1, t.frames
        assert finals[0]["type"] == "chat.done", finals[0]
        assert not t.resets
        variant = finals[0].get("variant", "baseline")
        wrong = variant == BAD and answers_wrong(r["prompt"], WRONG_SHARE)
        assert (t.text == faithful(r["prompt"])) is not wrong, (variant, t.text)
        assert t.request_id is not None
        by_request[t.request_id] = (variant, r["prompt"])
    on = {v: [rid for rid, (w, _) in by_request.items() if w == v] for v in (GOOD, BAD)}
    assert len(on[GOOD]) >= 10, by_request
    assert len(on[BAD]) >= 10, by_request
    expected_wrong = {rid for rid in on[BAD] if answers_wrong(by_request[rid][1], WRONG_SHARE)}
    assert 0 < len(expected_wrong) < len(on[BAD])

    # The scores: one per answer of a variant, none for the baseline's (the gold's own).
    shadowed = len(on[GOOD]) + len(on[BAD])
    await asyncio.to_thread(
        wait_until, lambda: len(read_scores(stack)) >= shadowed, 90, "every shadow score"
    )
    scores = await asyncio.to_thread(read_scores, stack)
    assert sorted(s.request_id for s in scores) == sorted(on[GOOD] + on[BAD])
    for s in scores:
        assert (s.model, s.gold, s.deterministic) == (MODEL, "baseline", True)
        assert s.variant == by_request[s.request_id][0]
        assert s.exact is (s.request_id not in expected_wrong), s
        assert s.quality == (1.0 if s.exact else 0.0)
    quality = {v: [s.quality for s in scores if s.variant == v] for v in (GOOD, BAD)}
    mean_good = sum(quality[GOOD]) / len(quality[GOOD])
    mean_bad = sum(quality[BAD]) / len(quality[BAD])
    assert mean_good == 1.0
    assert mean_bad == pytest.approx(1 - len(expected_wrong) / len(on[BAD]))
    assert mean_bad < 0.8
    # A wrong answer is other words, not merely other spacing: its ROUGE-L is low too.
    assert all(s.rouge_l < 0.9 for s in scores if s.request_id in expected_wrong)

    # The scheduler's quality metrics, per variant.
    for variant, values in quality.items():
        counted = counts(stack, variant, len(values))
        await asyncio.to_thread(wait_until, counted, 30, f"the scheduler's {variant} count")
        got = scheduler_metric(stack, "tokenbus_scheduler_shadow_quality_sum", variant)
        assert got == pytest.approx(sum(values))
    assert scheduler_metric(stack, "tokenbus_scheduler_shadow_quality_count", "baseline") is None

    # On the log too, each user's request has one final record: the gold runs added none.
    finals: dict[str, int] = {}
    for value in await stack.read_async(stack.topics.results):
        record = json.loads(value)
        if record["kind"] in ("done", "error"):
            finals[record["request_id"]] = finals.get(record["request_id"], 0) + 1
    assert finals == dict.fromkeys(by_request, 1)

    # The gold runs streamed to the shadow topic, each to its one final, never to a user.
    gold_finals = [
        r
        for r in (json.loads(v) for v in await stack.read_async(stack.topics.shadow))
        if r["kind"] in ("done", "error")
    ]
    assert sorted(r["request_id"] for r in gold_finals) == sorted(
        f"{rid}:gold" for rid in on[GOOD] + on[BAD]
    )
    assert {r["kind"] for r in gold_finals} == {"done"}
