"""`tokenbus eval --embedding-url URL --embedding-model NAME`: the embedding similarity of
every pair of answers the report compares (shared/embeddings.py), as shadow validation's
gold workers have it (ADR 0063).

Asked once the set has run, a few at a time, with a line on stderr per pair. A pair the
embedding API fails is reported without a similarity (its quality falls back to ROUGE-L),
and the failure is said on stderr: the answers the run took minutes to get are never lost
to it. The API key, where one is needed, comes from `TOKENBUS_EVAL_EMBEDDING_API_KEY`.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Set

from shared.embeddings import EmbeddingError, EmbeddingSimilarity

AT_ONCE = 4


async def similarities(
    pairs: Set[tuple[str, str]], embedding: EmbeddingSimilarity, prog: str
) -> dict[tuple[str, str], float]:
    """The similarity of each (reference, judged) pair the API answered for."""
    found: dict[tuple[str, str], float] = {}
    failed = 0
    gate = asyncio.Semaphore(AT_ONCE)

    async def one(pair: tuple[str, str]) -> None:
        nonlocal failed
        async with gate:
            try:
                found[pair] = await embedding(*pair)
            except EmbeddingError as exc:
                failed += 1
                print(f"{prog}: embedding failed, left out: {exc}", file=sys.stderr)
        print(
            f"{prog}: embeddings [{len(found) + failed}/{len(pairs)}] ({failed} failed)",
            file=sys.stderr,
            flush=True,
        )

    async with asyncio.TaskGroup() as tg:
        for pair in sorted(pairs):
            tg.create_task(one(pair))
    return found
