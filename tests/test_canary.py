"""The canary judgement (services/scheduler/canary.py): windows of heartbeat outcomes and
shadow scores, the verdict rule, and the rollback it calls for. Pure: plain values and a
given clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.scheduler.canary import CanaryRule, CanaryWindows, judge, quantile, rollback
from services.worker.outcomes import OutcomeCounts, ttft_bucket
from shared.messages import (
    OUTCOME_TTFT_BOUNDS_S,
    DoneResult,
    ErrorCode,
    ErrorResult,
    Heartbeat,
    Judged,
    Outcomes,
    QueuedRequest,
    ReplyTo,
    Tier,
    Timings,
    Usage,
)
from shared.shadows import ShadowScore
from shared.variants import ModelRollout, Variant
from shared.verdicts import VariantEvidence

MODEL = "m"
T0 = 1_000_000.0
RULE = CanaryRule(window_s=60.0, min_requests=20, min_scores=10)
REQUEST = QueuedRequest(
    request_id="r1",
    prompt="p",
    tier=Tier.interactive,
    prompt_tokens=1,
    reply_to=ReplyTo(topic="t.results", partition=0),
)


def shadow_score(
    variant: str | None,
    quality: float,
    scored_at: float,
    gold: str = "baseline",
    deterministic: bool = True,
    tenant: str | None = None,
) -> ShadowScore:
    return ShadowScore(
        model=MODEL,
        variant=variant,
        gold=gold,
        request_id="r1",
        exact=quality == 1.0,
        f1=quality,
        rouge_l=quality,
        quality=quality,
        deterministic=deterministic,
        scored_at=scored_at,
        tenant=tenant,
    )


class FakeWorker:
    """A worker's cumulative outcome counts, as its heartbeats carry them."""

    def __init__(self, worker_id: str, variant: str | None, started_at: float = T0) -> None:
        self.worker_id, self.variant, self.started_at = worker_id, variant, started_at
        self.counts = OutcomeCounts()

    def answer(self, n: int, ttft_s: float) -> None:
        for _ in range(n):
            self.counts.record(REQUEST, done(ttft_s))

    def fail(self, n: int) -> None:
        for _ in range(n):
            self.counts.record(REQUEST, error(ErrorCode.internal))

    def beat(self, at: float) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id,
            model=MODEL,
            variant=self.variant,
            total_slots=8,
            free_slots=8,
            running=0,
            queued_tokens=0,
            utilisation=0.0,
            sent_at=at,
            started_at=self.started_at,
            outcomes=self.counts.snapshot(),
        )


def done(ttft_s: float) -> DoneResult:
    return DoneResult(
        request_id="r1",
        seq=1,
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        timings=Timings(queue_ms=0, batch_size=1, ttft_ms=ttft_s * 1000, total_ms=ttft_s * 1000),
    )


def error(code: ErrorCode) -> ErrorResult:
    return ErrorResult(request_id="r1", seq=0, code=code, message="x")


def traffic(
    windows: CanaryWindows,
    *,
    base_ttft: float = 0.03,
    canary_ttft: float = 0.03,
    canary_fails: int = 0,
    n: int = 40,
) -> None:
    """n answers on the baseline and on the canary over 10 s, one beat a second."""
    base, canary = FakeWorker("w-base", None), FakeWorker("w-canary", "c")
    for second in range(11):
        at = T0 + second
        windows.beat(base.beat(at), at)
        windows.beat(canary.beat(at), at)
        if second < 10:
            base.answer(n // 10, base_ttft)
            canary.answer(n // 10, canary_ttft)
            canary.fail(canary_fails // 10)


def verdict_of(
    windows: CanaryWindows, now: float = T0 + 10.5, rule: CanaryRule = RULE
) -> VariantEvidence:
    found = judge(rule, MODEL, ["c"], windows, now, "s1").of("c")
    assert found is not None
    return found


def test_outcome_counts_bucket_answers_and_count_only_the_engines_failures() -> None:
    counts = OutcomeCounts()
    counts.record(REQUEST, done(0.03))
    counts.record(REQUEST, error(ErrorCode.internal))
    counts.record(REQUEST, error(ErrorCode.cancelled))
    counts.record(REQUEST, error(ErrorCode.invalid_request))
    # A shadow validation's gold run is not the worker's own traffic.
    gold_run = REQUEST.model_copy(
        update={"judged": Judged(request_id="r0", model=MODEL, variant="c", text="x")}
    )
    counts.record(gold_run, done(5.0))
    counts.record(gold_run, error(ErrorCode.internal))
    # Nor is a request pinned to the variant: a tenant who may pin could fail the canary,
    # or flood it with easy answers, at will (issue 37, N7).
    pinned = REQUEST.model_copy(update={"variant": "c"})
    counts.record(pinned, done(9.0))
    counts.record(pinned, error(ErrorCode.internal))
    snap = counts.snapshot()
    assert (snap.answered, snap.failed) == (1, 1)
    assert snap.ttft[ttft_bucket(0.03)] == 1
    assert sum(snap.ttft) == 1


def test_the_heartbeat_refuses_outcomes_with_another_number_of_buckets() -> None:
    with pytest.raises(ValueError, match="counts"):
        Outcomes(ttft=[0, 1])


@given(st.floats(min_value=0.0, max_value=100.0))
def test_a_time_falls_in_the_bucket_whose_bounds_hold_it(seconds: float) -> None:
    i = ttft_bucket(seconds)
    bounds = OUTCOME_TTFT_BOUNDS_S
    assert i == len(bounds) or seconds <= bounds[i]
    assert i == 0 or seconds > bounds[i - 1]


@given(st.lists(st.floats(min_value=0.0, max_value=30.0), min_size=1, max_size=200))
def test_the_p99_of_buckets_is_within_one_bucket_of_the_exact_one(times: list[float]) -> None:
    counts = [0] * (len(OUTCOME_TTFT_BOUNDS_S) + 1)
    for t in times:
        counts[ttft_bucket(t)] += 1
    got = quantile(counts, 0.99)
    assert got is not None
    exact = sorted(times)[max(0, -(-len(times) * 99 // 100) - 1)]
    bucket = ttft_bucket(exact)
    lower = 0.0 if bucket == 0 else OUTCOME_TTFT_BOUNDS_S[bucket - 1]
    assert lower - 1e-9 <= got <= OUTCOME_TTFT_BOUNDS_S[min(bucket, 40)] + 1e-9


def test_nothing_counted_has_no_quantile() -> None:
    assert quantile([0] * (len(OUTCOME_TTFT_BOUNDS_S) + 1), 0.99) is None


@given(st.permutations(range(12)), st.integers(min_value=1, max_value=3))
def test_repeated_and_late_beats_count_each_answer_once(order: list[int], copies: int) -> None:
    """Every beat arrives `copies` times (one per heartbeat partition), in any order: the
    window holds exactly what the worker counted after its first beat."""
    worker = FakeWorker("w", "c")
    beats = []
    for i in range(12):
        beats.append(worker.beat(T0 + i))
        worker.answer(i, 0.05)
    windows = CanaryWindows(60.0)
    windows.beat(beats[0], T0)  # the incarnation's first beat, seen first
    for i in order:
        for _ in range(copies):
            windows.beat(beats[i], T0 + 12)
    last = beats[-1].outcomes
    assert last is not None
    assert windows.tally(MODEL, "c", T0 + 12).answered == last.answered


def test_a_worker_counting_since_before_the_window_adds_only_what_follows() -> None:
    old = FakeWorker("w", None, started_at=T0 - 3600)
    old.answer(500, 0.05)
    windows = CanaryWindows(60.0)
    windows.beat(old.beat(T0), T0)
    old.answer(7, 0.05)
    windows.beat(old.beat(T0 + 1), T0 + 1)
    assert windows.tally(MODEL, None, T0 + 1).answered == 7


def test_a_new_incarnation_of_a_worker_counts_from_zero() -> None:
    windows = CanaryWindows(60.0)
    first = FakeWorker("w", None, started_at=T0)
    first.answer(10, 0.05)
    windows.beat(first.beat(T0 + 1), T0 + 1)
    again = FakeWorker("w", None, started_at=T0 + 2)  # restarted: its counts start over
    again.answer(3, 0.05)
    windows.beat(again.beat(T0 + 3), T0 + 3)
    assert windows.tally(MODEL, None, T0 + 3).answered == 13


def test_outcomes_leave_the_window_as_it_slides() -> None:
    windows = CanaryWindows(60.0)
    traffic(windows)
    assert windows.tally(MODEL, "c", T0 + 30).answered == 40
    assert windows.tally(MODEL, "c", T0 + 75).answered == 0


def test_alike_variants_are_ok() -> None:
    windows = CanaryWindows(60.0)
    traffic(windows)
    found = verdict_of(windows)
    assert found.verdict == "ok"
    assert found.regressed == []


def test_too_few_requests_is_no_verdict_either_way() -> None:
    windows = CanaryWindows(60.0)
    traffic(windows, n=10, canary_ttft=5.0)  # far slower, but 10 < 20 answers
    found = verdict_of(windows)
    assert found.verdict == "too_few"
    assert "20 needed" in found.reasons[0]


def test_a_slower_canary_regresses_on_ttft() -> None:
    windows = CanaryWindows(60.0)
    traffic(windows, canary_ttft=0.5)
    found = verdict_of(windows)
    assert found.verdict == "regressed"
    assert found.regressed == ["ttft"]
    assert "TTFT p99" in found.reasons[0]


def test_a_few_milliseconds_more_is_not_a_regression() -> None:
    """Twice the baseline's TTFT, but only 30 ms more: under the absolute excess."""
    windows = CanaryWindows(60.0)
    traffic(windows, base_ttft=0.03, canary_ttft=0.06)
    assert verdict_of(windows).verdict == "ok"


def test_a_failing_canary_regresses_on_errors() -> None:
    windows = CanaryWindows(60.0)
    traffic(windows, canary_fails=10)  # 10 of 50: 20 %
    found = verdict_of(windows)
    assert found.regressed == ["errors"]
    assert found.error_rate == pytest.approx(0.2)


def scores(windows: CanaryWindows, variant: str | None, qualities: list[float]) -> None:
    for i, q in enumerate(qualities):
        windows.score(shadow_score(variant, q, T0 + i * 0.1), T0 + 10)


def test_a_worse_answering_canary_regresses_on_quality_against_a_gold_baseline() -> None:
    windows = CanaryWindows(60.0)
    traffic(windows)
    scores(windows, "c", [1.0, 0.0] * 10)  # half its answers disagree with the gold
    found = verdict_of(windows)
    assert found.regressed == ["quality"]
    assert found.quality == pytest.approx(0.5)
    assert "against the baseline's 1.00" in found.reasons[0]


def test_quality_is_compared_with_the_baselines_own_scores_when_another_variant_is_gold() -> None:
    windows = CanaryWindows(60.0)
    traffic(windows)
    for variant, quality in ((None, 0.6), ("c", 0.55)):
        for i in range(10):
            windows.score(shadow_score(variant, quality, T0 + i, gold="fp16"), T0 + 10)
    assert verdict_of(windows).verdict == "ok"


def test_sampled_answers_are_not_held_to_a_gold_baseline_agreeing_with_itself() -> None:
    """Two samplings of one model differ: a ROUGE-L of 0.7 on sampled requests is no
    regression against a gold baseline, and says nothing either way."""
    windows = CanaryWindows(60.0)
    traffic(windows)
    for i in range(30):
        windows.score(shadow_score("c", 0.7, T0 + i * 0.1, deterministic=False), T0 + 10)
    found = verdict_of(windows)
    assert found.verdict == "too_few"
    assert "0 of 10 deterministic-request scores" in found.reasons
    assert found.quality == pytest.approx(0.7)


def test_few_scores_hold_a_promotion_back_but_none_do_not() -> None:
    windows = CanaryWindows(60.0)
    traffic(windows)
    scores(windows, "c", [1.0] * 5)
    assert verdict_of(windows).verdict == "too_few"


def test_a_rollback_sets_only_the_regressed_variants_with_a_share_to_zero() -> None:
    windows = CanaryWindows(60.0)
    traffic(windows)
    scores(windows, "c", [0.0] * 10)
    rollout = ModelRollout(
        model=MODEL,
        variants=[Variant(name="c", percent=50, quantization="fp8"), Variant(name="d", percent=5)],
        updated_at=T0,
    )
    verdicts = judge(RULE, MODEL, ["c", "d"], windows, T0 + 10.5, "s1")
    rolled = rollback(rollout, verdicts, "s1", T0 + 11)
    assert rolled is not None
    c, d = rolled.variants
    assert (c.name, c.percent, c.quantization) == ("c", 0.0, "fp8")
    assert c.rolled_back is not None
    assert c.rolled_back.checks == ["quality"]
    assert "quality 0.00" in c.rolled_back.reason
    assert [e.variant for e in c.rolled_back.evidence] == ["c", "baseline"]
    assert (d.percent, d.rolled_back) == (5, None)  # too few: left alone
    assert rolled.updated_at == T0 + 11
    # Once at 0, nothing more to write (a replica that read the rollback does nothing).
    assert rollback(rolled, verdicts, "s2", T0 + 12) is None
