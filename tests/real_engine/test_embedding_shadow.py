"""Shadow validation with an embedding model (issue 28): a gold worker asks a real embedding
model, SmolLM2 on vLLM's own server as a pooling model, how close each judged answer is to
its own, and the score carries that similarity, as quality for sampled requests.

One model with three sim workers, as tests/test_shadow_stack.py has them: the baseline (the
gold, the only one with `TOKENBUS_WORKER_EMBEDDING_URL`), a faithful variant `good` and a
variant `bad` that answers half its prompts wrongly. Sampled requests (temperature above 0,
no seed): a faithful answer is the gold's text again (the sim's text is a function of the
prompt and settings), so its embedding similarity is 1; a wrong one's is lower. Every score
has the similarity, and the scheduler's embedding histogram counts them per variant.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from services.worker.engines.sim_wrong import answers_wrong
from shared.embeddings import EmbeddingSimilarity
from shared.shadows import ShadowScore
from tests.chat_client import run_requests
from tests.real_engine.conftest import EMBEDDER
from tests.shadow_stack import (
    BAD,
    GOOD,
    MODEL,
    WRONG_SHARE,
    roll_out,
    scheduler_metric,
    shadow_stack,
)
from tests.stack import Stack, wait_until

pytestmark = pytest.mark.timeout(600)

REQUESTS = 40


@pytest.fixture(scope="module")
def embedding_stack(bootstrap: str, log_dir: Path, embedding_url: str) -> Iterator[Stack]:
    gold = {
        "TOKENBUS_WORKER_EMBEDDING_URL": embedding_url,
        "TOKENBUS_WORKER_EMBEDDING_MODEL": EMBEDDER,
    }
    with shadow_stack(bootstrap, log_dir, gold) as stack:
        yield stack


def request(i: int) -> dict[str, Any]:
    return {
        "client_id": f"c{i}",
        "conversation_id": f"conversation-{i}",
        "prompt": f"embedding question {i}: what does the bus carry?",
        "model": MODEL,
        "max_tokens": 16,
        "temperature": 0.8,  # sampled, no seed: quality is the embedding similarity
    }


async def test_the_embedding_model_tells_identical_text_from_other_text(embedding_url: str) -> None:
    similarity = EmbeddingSimilarity(embedding_url, EMBEDDER)
    same = await similarity("The bus carries tokens.", "The bus carries tokens.")
    other = await similarity("The bus carries tokens.", "Seven green turtles sleep.")
    assert same == pytest.approx(1.0, abs=1e-4)
    assert other < same - 1e-3, other


async def test_shadow_scores_carry_the_embedding_similarity(embedding_stack: Stack) -> None:
    stack = embedding_stack
    await roll_out(stack)
    requests = [request(i) for i in range(REQUESTS)]
    async with websockets.connect(stack.ws_url) as ws:
        transcripts = await run_requests(ws, requests, timeout=120)
    judged: dict[str, tuple[str, bool]] = {}  # request id -> (variant, answered wrongly)
    for r in requests:
        t = transcripts[r["client_id"]]
        [final] = [f for f in t.frames if f["type"] in ("chat.done", "error")]
        assert final["type"] == "chat.done", final
        variant = final.get("variant", "baseline")
        if variant in (GOOD, BAD) and t.request_id is not None:
            wrongly = variant == BAD and answers_wrong(r["prompt"], WRONG_SHARE)
            judged[t.request_id] = (variant, wrongly)
    wrong = {rid for rid, (_, w) in judged.items() if w}
    assert len(judged) >= 10, judged
    assert 0 < len(wrong) < len(judged), judged

    def scores() -> list[ShadowScore]:
        return [ShadowScore.model_validate_json(v) for v in stack.read(stack.topics.scores)]

    await asyncio.to_thread(
        wait_until, lambda: len(scores()) >= len(judged), 120, "every shadow score"
    )
    found = await asyncio.to_thread(scores)
    assert sorted(s.request_id for s in found) == sorted(judged)
    for s in found:
        assert s.embedding is not None, s
        assert not s.deterministic
        assert s.quality == pytest.approx(max(0.0, s.embedding))
        if s.request_id in wrong:
            assert not s.exact
            assert s.embedding < 0.999, s
        else:
            assert s.exact
            assert s.embedding == pytest.approx(1.0, abs=1e-4), s
    faithful = min(s.embedding or 0.0 for s in found if s.request_id not in wrong)
    assert max(s.embedding or 1.0 for s in found if s.request_id in wrong) < faithful

    # The scheduler's embedding histogram counts each variant's scores.
    for variant in (GOOD, BAD):
        n = sum(1 for s in found if s.variant == variant)

        def counted(variant: str = variant, n: int = n) -> bool:
            name = "tokenbus_scheduler_shadow_embedding_count"
            return scheduler_metric(stack, name, variant) == n

        await asyncio.to_thread(wait_until, counted, 30, f"the scheduler's {variant} count")
