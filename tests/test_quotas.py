"""Quota policy with a fake clock: each limit refuses, says when to retry, and recovers."""

from __future__ import annotations

import pytest

from services.edge.quotas import (
    SCANNED_PER_REQUEST,
    SLOT_RETRY_AFTER_MS,
    Quotas,
    TenantLimits,
    TokenBucket,
)
from tests.fakes import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


BIG = TenantLimits(rps=1000, concurrency=1000, tokens_per_min=10**9, sockets=1000)


def test_bucket_refills_at_its_rate_and_never_above_capacity() -> None:
    bucket = TokenBucket(rate=2.0, capacity=4.0, now=0.0)
    bucket.take(4, now=0.0)
    assert bucket.wait_s(1, now=0.0) == pytest.approx(0.5)
    assert bucket.wait_s(1, now=0.5) == 0.0
    assert bucket.wait_s(4, now=100.0) == 0.0
    assert bucket.level == 4.0
    assert bucket.wait_s(5, now=100.0) is None  # more than it can ever hold


def test_rps_allows_the_burst_then_refuses_with_the_time_to_the_next_token(
    clock: FakeClock,
) -> None:
    q = Quotas(clock)
    limits = BIG.model_copy(update={"rps": 2.0, "burst": 3})
    assert [q.admit("a", limits, f"r{i}", 1) for i in range(3)] == [None] * 3
    refusal = q.admit("a", limits, "r3", 1)
    assert refusal is not None
    assert refusal.limit == "rps"
    assert refusal.retry_after_ms == 500
    clock.now += 0.5
    assert q.admit("a", limits, "r3", 1) is None


def test_burst_defaults_to_one_second_of_rate() -> None:
    assert TenantLimits(rps=2.5).request_burst == 3
    assert TenantLimits(rps=0.2).request_burst == 1


def test_concurrency_counts_streams_until_released(clock: FakeClock) -> None:
    q = Quotas(clock)
    limits = BIG.model_copy(update={"concurrency": 2})
    assert q.admit("a", limits, "r1", 1) is None
    assert q.admit("a", limits, "r2", 1) is None
    refusal = q.admit("a", limits, "r3", 1)
    assert refusal is not None
    assert refusal.limit == "concurrency"
    assert refusal.retry_after_ms is not None
    q.release("r1")
    q.release("r1")  # twice, or unknown: no effect
    q.release("never-admitted")
    assert q.in_flight("a") == 1
    assert q.admit("a", limits, "r3", 1) is None


def test_tokens_per_minute_charges_at_admission_and_refills(clock: FakeClock) -> None:
    q = Quotas(clock)
    limits = BIG.model_copy(update={"tokens_per_min": 600})  # 10 tokens a second
    assert q.admit("a", limits, "r1", 500) is None
    refusal = q.admit("a", limits, "r2", 200)
    assert refusal is not None
    assert refusal.limit == "tokens_per_min"
    assert refusal.retry_after_ms == 10_000  # 100 tokens short at 10 a second
    clock.now += 10
    assert q.admit("a", limits, "r2", 200) is None


def test_a_request_above_the_whole_minute_is_refused_without_a_retry_hint(
    clock: FakeClock,
) -> None:
    q = Quotas(clock)
    refusal = q.admit("a", BIG.model_copy(update={"tokens_per_min": 100}), "r1", 101)
    assert refusal is not None
    assert refusal.limit == "tokens_per_min"
    assert refusal.retry_after_ms is None
    assert refusal.never  # told as invalid_request, not rate_limited (issue 37)


def test_a_refusal_charges_nothing(clock: FakeClock) -> None:
    q = Quotas(clock)
    limits = BIG.model_copy(update={"rps": 1.0, "burst": 1, "tokens_per_min": 100})
    assert q.admit("a", limits, "big", 1000) is not None  # refused by tokens, after rps passed
    assert q.admit("a", limits, "ok", 10) is None  # so the one request token is still there
    assert q.in_flight("a") == 1


def test_sockets_are_counted_per_tenant(clock: FakeClock) -> None:
    q = Quotas(clock)
    limits = BIG.model_copy(update={"sockets": 2})
    assert q.open_socket("a", limits) is None
    assert q.open_socket("a", limits) is None
    refusal = q.open_socket("a", limits)
    assert refusal is not None
    assert refusal.limit == "sockets"
    assert q.open_socket("b", limits) is None  # another tenant has its own count
    q.close_socket("a")
    assert q.open_socket("a", limits) is None


def test_tenants_do_not_share_buckets(clock: FakeClock) -> None:
    q = Quotas(clock)
    limits = BIG.model_copy(update={"rps": 1.0, "burst": 1})
    assert q.admit("a", limits, "a1", 1) is None
    assert q.admit("a", limits, "a2", 1) is not None
    assert q.admit("b", limits, "b1", 1) is None


def test_new_limits_apply_to_a_tenant_in_use(clock: FakeClock) -> None:
    q = Quotas(clock)
    assert q.admit("a", BIG, "r1", 1) is None
    tighter = BIG.model_copy(update={"concurrency": 1})
    refusal = q.admit("a", tighter, "r2", 1)
    assert refusal is not None
    assert refusal.limit == "concurrency"


def test_a_tenants_replays_are_bounded_by_partition_and_charged_by_what_they_read(
    clock: FakeClock,
) -> None:
    """Issue 37, N8: one tenant's resumes read at most `replays` partitions at once (each a
    reader of the edge's few), any number of resumes of a partition it reads already (an
    edge's death: every stream of one partition resumed at once); and a replay that read far
    back costs its tenant a request per SCANNED_PER_REQUEST records."""
    q = Quotas(clock)
    limits = BIG.model_copy(update={"rps": 1.0, "burst": 10, "replays": 2})
    assert q.start_replay("a", limits, "r/0") is None
    assert q.start_replay("a", limits, "r/1") is None
    assert [q.start_replay("a", limits, "r/0") for _ in range(30)] == [None] * 30
    refusal = q.start_replay("a", limits, "r/2")
    assert refusal is not None
    assert (refusal.limit, refusal.retry_after_ms) == ("replays", SLOT_RETRY_AFTER_MS)
    assert q.start_replay("b", limits, "r/2") is None  # another tenant's places are its own
    q.end_replay("a", "r/1", scanned=3 * SCANNED_PER_REQUEST + 999)  # three requests' worth
    assert q.start_replay("a", limits, "r/2") is None  # r/1's place is back
    for _ in range(31):
        q.end_replay("a", "r/0", scanned=0)
    assert q.start_replay("a", limits, "r/3") is None  # r/0's too, once its last resume ended
    q.end_replay("a", "r/2", scanned=7 * SCANNED_PER_REQUEST)  # ten requests in all: the burst
    refused = q.charge("a", limits)
    assert refused is not None
    assert refused.limit == "rps"
    clock.now += 1.0
    assert q.charge("a", limits) is None


def test_a_tenants_guided_streams_are_bounded_apart_from_its_others(clock: FakeClock) -> None:
    """Issue 37, N2: each guided stream is a grammar the engine compiles; one tenant keeps at
    most `guided` of them in flight, its unguided requests unaffected."""
    q = Quotas(clock)
    limits = BIG.model_copy(update={"guided": 2})
    assert q.admit("a", limits, "g1", 1, guided=True) is None
    assert q.admit("a", limits, "g2", 1, guided=True) is None
    refusal = q.admit("a", limits, "g3", 1, guided=True)
    assert refusal is not None
    assert (refusal.limit, refusal.retry_after_ms) == ("guided", SLOT_RETRY_AFTER_MS)
    assert q.admit("a", limits, "plain", 1) is None  # not guided: not counted
    assert q.admit("b", limits, "g1-b", 1, guided=True) is None  # each tenant its own
    q.release("g1")
    assert q.admit("a", limits, "g3", 1, guided=True) is None
