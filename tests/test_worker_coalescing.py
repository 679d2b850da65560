"""Coalescing on the real broker: 16 concurrent sim requests, chunks instead of tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.coalescing import measure
from services.worker.coalesce import Coalescer
from shared.messages import TokenLogprob


def test_coalescer_flushes_on_size_on_age_and_reports_the_wait() -> None:
    c = Coalescer(flush_seconds=0.020, flush_tokens=3)
    assert c.flush_at() is None
    assert c.add("a", 1, now=1.000) is None
    assert c.flush_at() == 1.020
    assert c.add("b", 1, now=1.005) is None
    assert c.add("c", 1, now=1.010) == "abc"  # size
    assert c.last_wait == pytest.approx(0.010)
    assert c.add("d", 1, now=1.015) is None
    assert c.take(now=1.036) == "d"  # age: the timer's flush, 1 ms late
    assert c.last_overdue == pytest.approx(0.001)
    assert c.take(now=2.0) is None


def test_chunk_leaves_when_the_next_token_would_find_it_overdue() -> None:
    c = Coalescer(flush_seconds=0.020, flush_tokens=16)
    steps = [c.add(t, 1, now=1.0 + 0.0066 * i) for i, t in enumerate("abcdefgh")]
    # Tokens every 6.6 ms: the 4th (age 19.8 ms) leaves with the chunk, since the 5th would
    # make the oldest wait 26.4 ms; chunks are then 4 steps apart, within 20 ms + one step.
    assert steps == [None, None, None, "abcd", None, None, None, "efgh"]
    slow = Coalescer(flush_seconds=0.020, flush_tokens=16)
    assert slow.add("x", 1, now=1.0) is None
    assert slow.add("y", 1, now=1.030) == "xy"  # overdue already
    assert slow.add("z", 1, now=1.060) == "z"  # a 30 ms step: holding z gains nothing


def test_first_token_leaves_at_once_then_chunks_resume() -> None:
    c = Coalescer(flush_seconds=0.020, flush_tokens=3, first_at_once=True)
    assert c.add("", 1, now=1.000) is None  # a token with no text yet is not 'first'
    assert c.add("Hi", 1, now=1.001) == "Hi"
    assert c.add(" there", 1, now=1.002) is None
    assert c.add(" you", 1, now=1.003) is None
    assert c.add(".", 1, now=1.004) == " there you."


def lp(token: str) -> TokenLogprob:
    return TokenLogprob(token=token, logprob=-1.0)


def test_coalesced_chunks_carry_their_deltas_logprobs_in_order() -> None:
    c = Coalescer(flush_seconds=0.020, flush_tokens=3)
    assert c.add("a", 1, now=1.000, logprobs=[lp("a")]) is None
    assert c.add("", 1, now=1.001, logprobs=[lp("\ufffd")]) is None  # a part of a character
    assert c.add("bc", 2, now=1.002, logprobs=[lp("b"), lp("c")]) == "abc"
    assert c.last_logprobs == [lp("a"), lp("\ufffd"), lp("b"), lp("c")]
    # An empty chunk still carries its tokens' logprobs (the caller sends it).
    assert c.add("", 1, now=1.003, logprobs=[lp("x")]) is None
    assert c.take(now=1.030) == ""
    assert c.last_logprobs == [lp("x")]
    # Deltas without logprobs (none asked) make chunks without them.
    assert c.add("d", 3, now=1.040) == "d"
    assert c.last_logprobs is None


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


def test_counts_cover_every_token_once_even_past_a_chunk_not_sent() -> None:
    """`continuous_usage_stats` (issue 42): a chunk taken but not sent (a token whose text is
    not whole yet) leaves its counts to the next chunk sent; the prompt's come once."""
    c = Coalescer(flush_seconds=0.020, flush_tokens=1)
    assert c.add("", 1, 0.0, prompt_tokens=7) == ""  # taken, nothing to send
    assert c.add("é", 1, 0.001) == "é"
    assert c.counts() == (2, 7)
    assert c.add("x", 1, 0.002) == "x"
    assert c.counts() == (1, None)
