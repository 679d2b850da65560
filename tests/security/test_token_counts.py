"""Token counts an attacker cannot shrink: a prompt is charged at least what the model sees.

Before: a run of word characters counted as one token, so 65,536 `a`s (or CJK characters)
were charged as 1 token against tokens per minute, batch budgets and fair share. Now a
request is charged its prompt's UTF-8 bytes plus a template allowance before it runs (no
byte-level tokenizer makes more tokens than bytes), and the edge settles the charge with the
real `usage` when it ends (ADR 0046).

Each attack goes over a real WebSocket to a real edge of a real stack (the `sim` engine): the
session's shared one, where the module's tenants have their own limits (`tests/tenants.py`,
`TOKEN_COUNTS`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import websockets

from services.edge.quotas import Quotas, TenantLimits
from shared.messages import ChatMessage, ChatRequest
from shared.tokens import (
    TEMPLATE_TOKENS_PER_MESSAGE,
    TEMPLATE_TOKENS_PER_REQUEST,
    prompt_token_bound,
    sim_tokens,
)
from tests.chat_client import bearer, recv_json, run_requests
from tests.stack import Stack

LONGEST = 65_536  # the default max_prompt_chars
LETTERS = "a" * LONGEST
CJK = "漢" * LONGEST  # 3 UTF-8 bytes each


async def refusal(stack: Stack, tenant: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Send one request as `tenant`; its first answer frame."""
    request = {"type": "chat.request", "client_id": "x", "prompt": prompt, "max_tokens": max_tokens}
    async with websockets.connect(stack.ws_url_as(None), **bearer(stack, tenant)) as ws:
        await ws.send(json.dumps(request))
        return await recv_json(ws)


async def on_kafka(stack: Stack) -> set[str]:
    return {json.loads(v)["prompt"] or "" for v in await stack.read_requests()}


# -- the bound -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", [LETTERS, CJK, "😀" * 1000, " \n\t" * 1000, "x"])
def test_the_bound_is_never_below_the_bytes(text: str) -> None:
    assert sim_tokens(LETTERS) == 1  # what the old count charged for 65,536 letters
    bytes_ = len(text.encode())
    assert prompt_token_bound(text) == bytes_ + TEMPLATE_TOKENS_PER_REQUEST + 8
    part = text[:1000]
    chat = ChatRequest(messages=[ChatMessage(role="user", content=part)] * 3)
    template = 3 * TEMPLATE_TOKENS_PER_MESSAGE + TEMPLATE_TOKENS_PER_REQUEST
    assert chat.prompt_token_bound() >= 3 * len(part.encode()) + template


# -- the attacks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "limit"),
    [(LETTERS, "(tokens_per_min)"), (CJK, "above the largest batch token budget")],
    ids=["letters", "cjk"],
)
async def test_a_long_unbroken_prompt_is_charged_by_its_size(
    stack: Stack, prompt: str, limit: str
) -> None:
    """A tenant of 10,000 tokens a minute sends one 65,536-character prompt: refused for
    good (no retry hint); before, it was charged 1 token + max_tokens and ran. Invalid, not
    rate limited, as no wait could admit it (issue 37); the CJK one (~196,000 bytes) is
    above every batch budget too, which is said first, for every tenant alike."""
    frame = await refusal(stack, "counts-capped", prompt, 16)
    assert (frame["type"], frame.get("code")) == ("error", "invalid_request"), frame
    assert limit in frame["message"], frame
    assert frame["retry_after_ms"] is None, frame
    assert prompt not in await on_kafka(stack)


async def test_a_prompt_no_batch_could_hold_is_refused_at_the_edge(stack: Stack) -> None:
    """65,536 CJK characters are ~196,000 bytes: above the largest batch budget (131,072),
    so no batch could ever hold it. Before: charged 1 token, queued and run."""
    frame = await refusal(stack, "counts-unmetered", CJK, 16)
    assert (frame["type"], frame.get("code")) == ("error", "invalid_request"), frame
    assert "above the largest batch token budget" in frame["message"], frame
    assert CJK not in await on_kafka(stack)


# -- settling with the real usage ----------------------------------------------------------


def words(n_bytes: int) -> str:
    """Text of `n_bytes` bytes in long words: few tokens by the sim's count (its usage)."""
    word = uuid.uuid4().hex[:19] + " "  # 20 bytes, one sim token
    return (word * (n_bytes // len(word) + 1))[:n_bytes]


async def test_the_tenant_gets_back_what_a_request_did_not_use(stack: Stack) -> None:
    """A request charged ~4,100 tokens that used ~300 gives the difference back at its end,
    so a next request charged 5,000 fits the tenant's 6,000 a minute at once; without the
    settle it would wait ~30 s for the bucket to refill."""
    first, second = words(4_000), words(4_900)
    async with websockets.connect(stack.ws_url_as(None), **bearer(stack, "counts-settling")) as ws:
        done = await run_requests(ws, [{"client_id": "a", "prompt": first, "max_tokens": 60}])
        final = done["a"].final
        assert final is not None, done["a"].frames
        assert final["type"] == "chat.done", final
        used = final["usage"]["prompt_tokens"] + final["usage"]["completion_tokens"]
        charged = prompt_token_bound(first) + 60
        assert charged - used > 3_500  # what the settle gives back
        # Without the settle: 1,900 left, 100 more a second; 5,000 would not fit for 30 s.
        assert prompt_token_bound(second) + 60 == 5_000 > 6_000 - charged + 100 * 30
        done = await run_requests(ws, [{"client_id": "b", "prompt": second, "max_tokens": 60}])
        assert done["b"].frames[0]["type"] == "chat.accepted", done["b"].frames
    assert second in await on_kafka(stack)


def test_settle_gives_back_or_takes_the_difference_once() -> None:
    now = [0.0]
    quotas = Quotas(clock=lambda: now[0])
    limits = TenantLimits(tokens_per_min=1_000)
    assert quotas.admit("t", limits, "r1", 900) is None
    assert quotas.admit("t", limits, "r2", 200) is not None  # 100 left
    quotas.settle("r1", 150)  # 750 back
    quotas.settle("r1", 0)  # once: a duplicate done gives nothing more
    quotas.release("r1")
    assert quotas.admit("t", limits, "r2", 850) is None  # 850 there, none refilled
    quotas.settle("r2", 1_000)  # used more than charged: 150 more taken
    quotas.release("r2")
    refused = quotas.admit("t", limits, "r3", 1)
    assert refused is not None
    assert refused.limit == "tokens_per_min"
    now[0] += 9.0  # 150 refilled: back at zero, 1 more needs a tick
    assert quotas.admit("t", limits, "r3", 1) is not None
    now[0] += 0.1
    assert quotas.admit("t", limits, "r3", 1) is None
    quotas.settle("unknown", 5)  # a stream resumed from another edge: charged there
