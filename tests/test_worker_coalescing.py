"""Coalescing on the real broker: 16 concurrent sim requests, chunks instead of tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.coalescing import measure
from services.worker.coalesce import Coalescer


def test_coalescer_flushes_on_size_on_age_and_reports_the_wait() -> None:
    c = Coalescer(flush_seconds=0.020, flush_tokens=3)
    assert c.flush_at() is None
    assert c.add("a", 1, now=1.000) is None
    assert c.flush_at() == 1.020
    assert c.add("b", 1, now=1.005) is None
    assert c.add("c", 1, now=1.010) == "abc"  # size
    assert c.last_wait == pytest.approx(0.010)
    assert c.add("d", 1, now=1.100) is None
    assert c.add("e", 1, now=1.121) == "de"  # age: the oldest waited 21 ms
    assert c.take(now=2.0) is None


def test_first_token_leaves_at_once_then_chunks_resume() -> None:
    c = Coalescer(flush_seconds=0.020, flush_tokens=3, first_at_once=True)
    assert c.add("", 1, now=1.000) is None  # a token with no text yet is not 'first'
    assert c.add("Hi", 1, now=1.001) == "Hi"
    assert c.add(" there", 1, now=1.002) is None
    assert c.add(" you", 1, now=1.003) is None
    assert c.add(".", 1, now=1.004) == " there you."


async def test_sixteen_streams_carry_at_most_one_record_per_three_tokens(
    bootstrap: str, log_dir: Path
) -> None:
    run = await measure(
        bootstrap, profile="llama3-8b-h200", requests=16, max_tokens=128, log_dir=log_dir
    )
    print("\n", run.row())
    assert run.final_records == 16
    # Every record counts, the final done records included.
    assert run.records_per_token <= 1 / 3
    # Coalescing adds at most flush_ms to the engine's own pauses (a step when it keeps
    # time), beyond how late this shared machine fired the flush timer.
    added = run.worker_gap_over_engine_ms["max"]
    assert added <= run.flush_ms + run.worker_flush_lateness_ms["max"] + 2.0
