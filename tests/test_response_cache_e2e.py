"""The response cache through a real stack: a repeated deterministic request is answered by
ingest from the cache topic (no batch reaches a worker), and a restarted ingest still hits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import websockets

from shared.messages import Batch, CacheEntry
from tests.chat_client import Transcript, run_requests
from tests.stack import Stack, wait_until


@pytest.fixture(scope="module")
def stack(own_stack: Stack) -> Stack:
    """A stack of the module's own, not the session's: it restarts ingest and reads its log."""
    return own_stack


async def ask(stack: Stack, request: dict[str, Any]) -> Transcript:
    async with websockets.connect(stack.ws_url) as ws:
        return (await run_requests(ws, [request]))[request["client_id"]]


def done_of(t: Transcript) -> dict[str, Any]:
    final = t.final
    assert final is not None, t.frames
    assert final["type"] == "chat.done", t.frames
    seqs = [d["seq"] for d in t.deltas]
    assert seqs == list(range(len(seqs))), f"seq out of order: {seqs}"
    return final


async def batched(stack: Stack, request_id: str) -> int:
    """How many times a batch carried this request to a worker."""
    batches = [Batch.model_validate_json(v) for v in await stack.read_async(stack.topics.batches)]
    return sum(r.request_id == request_id for b in batches for r in b.requests)


async def cached_ids(stack: Stack) -> set[str]:
    """Ids of the requests whose answers workers stored on the cache topic."""
    values = await stack.read_async(stack.topics.cache)
    return {CacheEntry.model_validate_json(v).request_id for v in values}


async def followed(stack: Stack, request_id: str) -> None:
    """Until ingest has taken the answer to `request_id` from the cache topic."""
    await asyncio.to_thread(
        wait_until,
        lambda: request_id in _cache_lines(stack),
        60,
        f"ingest to follow the cached answer of {request_id}",
    )


def _cache_lines(stack: Stack) -> str:
    lines = stack.log("ingest").read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines if "cache.added" in line)


def deterministic(client_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "client_id": client_id,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"what is a compacted topic? ({client_id})"},
        ],
        "max_tokens": 40,
        "temperature": 0,
        **fields,
    }


async def test_a_repeated_deterministic_request_is_answered_from_the_cache(stack: Stack) -> None:
    first = await ask(stack, deterministic("a1"))
    assert first.request_id is not None
    first_done = done_of(first)
    assert first_done["cached"] is False
    await followed(stack, first.request_id)

    again = deterministic("a1")
    again["client_id"] = "a2"  # another client, same request fields
    second = await ask(stack, again)
    assert second.request_id is not None
    assert second.request_id != first.request_id
    second_done = done_of(second)
    assert second_done["cached"] is True, second.frames
    assert second.text
    assert second.text == first.text
    assert second_done["finish_reason"] == first_done["finish_reason"]
    assert second_done["usage"] == first_done["usage"]
    # The worker ran the first one only: no batch ever carried the second.
    assert await batched(stack, first.request_id) == 1
    assert await batched(stack, second.request_id) == 0


async def test_sampled_or_opted_out_requests_are_never_cached(stack: Stack) -> None:
    sampled = deterministic("s", temperature=0.7)
    opted_out = deterministic("o", cache=False)
    runs: list[Transcript] = []
    for request in (sampled, opted_out, sampled, opted_out):
        runs.append(
            await ask(stack, {**request, "client_id": f"{request['client_id']}{len(runs)}"})
        )
    for t in runs:
        assert t.request_id is not None
        assert done_of(t)["cached"] is False
        assert await batched(stack, t.request_id) == 1
    # Nothing of theirs was stored (a deterministic one of the same stack was: see above).
    stored = await cached_ids(stack)
    assert not stored & {t.request_id for t in runs}


async def test_a_restarted_ingest_still_hits(stack: Stack) -> None:
    request = deterministic("r1", seed=7, temperature=0.9)  # a seeded sample is deterministic
    first = await ask(stack, request)
    assert first.request_id is not None
    assert done_of(first)["cached"] is False
    await followed(stack, first.request_id)

    await asyncio.to_thread(stack.stop_service, "ingest")
    stack.start_service("ingest")
    second = await ask(stack, {**request, "client_id": "r2"})
    assert second.request_id is not None
    assert done_of(second)["cached"] is True, second.frames
    assert second.text == first.text
    assert await batched(stack, second.request_id) == 0
    # Loaded at each start, the second time with the answer in it.
    assert stack.log("ingest").read_text(errors="replace").count("cache.loaded") == 2
