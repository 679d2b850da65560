"""Canary judgement: each variant's sliding window of outcomes and shadow scores, compared
with its baseline's, and the rollback a regression calls for. Pure: heartbeats and scores in
(with the time), verdicts and rollouts out; `rollback.py` acts on them (ADR 0058).

Workers count their requests since they started (`Heartbeat.outcomes`); the window holds
the differences between one incarnation's successive counts, stamped with the beat's send
time, so every scheduler that reads the same heartbeats holds the same window, and a lost,
late or repeated beat changes nothing (the next one carries the same totals). Shadow scores
(shared/shadows.py: one per sampled request, how well the variant's answer agreed with the
gold variant's, ADR 0057) go into the same window by their `scored_at`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shared.messages import OUTCOME_TTFT_BOUNDS_S, Heartbeat
from shared.shadows import ShadowScore
from shared.tenant_share import SLICE_S, capped
from shared.variants import BASELINE, ModelRollout, Variant
from shared.verdicts import CHECKS, Check, ModelVerdicts, RolledBack, VariantEvidence

P99 = 0.99
# An incarnation silent this long past the window is forgotten (its counts can add nothing).
FORGET_AFTER_S = 60.0


@dataclass(frozen=True)
class CanaryRule:
    """When a variant has regressed against its baseline (scheduler settings)."""

    window_s: float = 60.0
    min_requests: int = 50  # answered + failed, each side, for TTFT and errors
    min_scores: int = 20  # shadow scores of the variant, for quality
    ttft_p99_ratio: float = 1.5  # regressed above the baseline's p99 times this...
    ttft_min_excess_s: float = 0.1  # ...and by more than this
    error_rate_excess: float = 0.02  # regressed above the baseline's error rate plus this
    quality_drop: float = 0.1  # regressed below the baseline's quality minus this


@dataclass
class Tally:
    """What a window holds for one (model, variant)."""

    answered: int = 0
    failed: int = 0
    ttft: list[int] = field(default_factory=lambda: [0] * (len(OUTCOME_TTFT_BOUNDS_S) + 1))
    qualities: list[float] = field(default_factory=list)
    greedy: list[float] = field(default_factory=list)  # of deterministic requests only

    @property
    def requests(self) -> int:
        return self.answered + self.failed


@dataclass(frozen=True)
class _Slice:
    at: float
    answered: int
    failed: int
    ttft: tuple[tuple[int, int], ...]  # (bucket, count), the buckets that grew


@dataclass(frozen=True)
class _Scored:
    at: float
    quality: float
    deterministic: bool
    tenant: str | None


@dataclass
class _Seen:
    """One worker incarnation's largest counts so far."""

    answered: int
    failed: int
    ttft: list[int]
    seen_at: float


Key = tuple[str, str | None]  # (model, variant; None: the baseline)


class CanaryWindows:
    """Each (model, variant)'s outcomes and scores of the last `window_s`.

    Caller: the heartbeat reader (`beat`), the scores reader (`score`) and the judge
    (`tally`), on one event loop. Affects: only itself.
    """

    def __init__(self, window_s: float, tenant_share: float = 1.0, tenant_floor: int = 0) -> None:
        self.window_s = window_s
        # No tenant above this share of a window's scores (issue 37, N7): the floor is per
        # SLICE_S, as the workers apply it to their outcomes.
        self._share = tenant_share
        self._floor = math.floor(tenant_floor * window_s / SLICE_S)
        self._seen: dict[tuple[str, float], _Seen] = {}
        self._slices: dict[Key, deque[_Slice]] = {}
        self._scores: dict[Key, deque[_Scored]] = {}
        self.golds: dict[str, str] = {}  # model -> the gold of its latest score

    def beat(self, beat: Heartbeat, now: float) -> None:
        """A heartbeat (read live or replayed): what its worker counted since the last."""
        counts = beat.outcomes
        if counts is None:
            return
        incarnation = (beat.worker_id, beat.started_at)
        at = min(beat.sent_at, now)
        seen = self._seen.get(incarnation)
        if seen is None:
            seen = self._seen[incarnation] = _Seen(0, 0, [0] * len(counts.ttft), at)
            if now - beat.started_at > self.window_s:
                # Counted before the window: only what comes after is news.
                seen.answered, seen.failed, seen.ttft = counts.answered, counts.failed, counts.ttft
                return
        grown = tuple((i, n - seen.ttft[i]) for i, n in enumerate(counts.ttft) if n > seen.ttft[i])
        answered = max(0, counts.answered - seen.answered)
        failed = max(0, counts.failed - seen.failed)
        # A late copy of an older beat carries smaller counts: it adds nothing, lowers nothing.
        seen.answered = max(seen.answered, counts.answered)
        seen.failed = max(seen.failed, counts.failed)
        seen.ttft = [max(a, b) for a, b in zip(seen.ttft, counts.ttft, strict=True)]
        seen.seen_at = max(seen.seen_at, at)
        if answered or failed or grown:
            key = (beat.model, beat.variant)
            self._slices.setdefault(key, deque()).append(_Slice(at, answered, failed, grown))
        self._prune(now)

    def score(self, score: ShadowScore, now: float) -> None:
        """A shadow score of one sampled request of `score.variant`."""
        key = (score.model, score.variant)
        scored = _Scored(
            min(score.scored_at, now), score.quality, score.deterministic, score.tenant
        )
        self._scores.setdefault(key, deque()).append(scored)
        self.golds[score.model] = score.gold
        self._prune(now)

    def tally(self, model: str, variant: str | None, now: float) -> Tally:
        """The window ending `now` of one variant (None: the baseline)."""
        since = now - self.window_s
        out = Tally()
        for s in self._slices.get((model, variant), ()):
            if s.at > since:
                out.answered += s.answered
                out.failed += s.failed
                for i, n in s.ttft:
                    out.ttft[i] += n
        window = [s for s in self._scores.get((model, variant), ()) if s.at > since]
        scores = capped(window, lambda s: s.tenant or "", self._share, self._floor)
        out.qualities = [s.quality for s in scores]
        out.greedy = [s.quality for s in scores if s.deterministic]
        return out

    def _prune(self, now: float) -> None:
        since = now - self.window_s
        for windows in (self._slices, self._scores):
            for key in list(windows):
                held = windows[key]
                while held and held[0].at <= since:
                    held.popleft()
        forget = since - FORGET_AFTER_S
        for incarnation in [k for k, v in self._seen.items() if v.seen_at < forget]:
            del self._seen[incarnation]


def quantile(counts: Sequence[int], q: float) -> float | None:
    """The q-quantile (seconds) of bucketed times, interpolated within its bucket as
    Prometheus's `histogram_quantile` does; None when nothing was counted."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    below = 0
    bounds = OUTCOME_TTFT_BOUNDS_S
    for i, n in enumerate(counts):
        if n and below + n >= rank:
            if i == len(bounds):  # beyond the last bound: say the last bound
                return bounds[-1]
            lower = 0.0 if i == 0 else bounds[i - 1]
            return lower + (bounds[i] - lower) * (rank - below) / n
        below += n
    return bounds[-1]


def judge(
    rule: CanaryRule,
    model: str,
    variants: Iterable[str],
    windows: CanaryWindows,
    now: float,
    scheduler_id: str,
) -> ModelVerdicts:
    """Every variant's window against the baseline's, the baseline first."""
    base = windows.tally(model, None, now)
    # Another variant is the gold: the baseline has scores of its own, compared like for
    # like. The baseline is the gold: it agrees with itself, 1 by definition, but only on
    # deterministic requests (two samplings of one model differ), so only those count.
    gold_is_base = windows.golds.get(model) == BASELINE
    reference: Reference | None = None
    if len(base.qualities) >= rule.min_scores:
        reference = Reference(_mean(base.qualities), greedy_only=False)
    elif gold_is_base:
        reference = Reference(1.0, greedy_only=True)
    rows = [_evidence(BASELINE, base, "reference", [], [])]
    for name in variants:
        tally = windows.tally(model, name, now)
        found = [
            _ttft(rule, tally, base),
            _errors(rule, tally, base),
            _quality(rule, tally, reference),
        ]
        worse = sorted((f for f in found if f.regressed), key=lambda f: CHECKS.index(f.check))
        # The regressions' reasons first, then what evidence is still wanting.
        reasons = [f.reason for f in worse] + [
            f.reason for f in found if f.reason and not f.regressed
        ]
        if worse:
            verdict = "regressed"
        elif all(f.passed for f in found):
            verdict = "ok"
        else:
            verdict = "too_few"
        rows.append(_evidence(name, tally, verdict, [f.check for f in worse], reasons))
    return ModelVerdicts(
        model=model,
        scheduler_id=scheduler_id,
        judged_at=now,
        window_s=windows.window_s,
        variants=rows,
    )


@dataclass(frozen=True)
class _Found:
    check: Check
    passed: bool  # enough evidence, and no regression (or nothing to measure: quality)
    regressed: bool = False
    reason: str = ""


def _ttft(rule: CanaryRule, tally: Tally, base: Tally) -> _Found:
    if min(tally.answered, base.answered) < rule.min_requests:
        return _Found(
            "ttft", False, reason=_too_few("answers", tally.answered, base.answered, rule)
        )
    mine, theirs = quantile(tally.ttft, P99), quantile(base.ttft, P99)
    if mine is None or theirs is None:  # not reached: both answered some
        return _Found("ttft", False)
    worse = mine > theirs * rule.ttft_p99_ratio and mine - theirs > rule.ttft_min_excess_s
    if not worse:
        return _Found("ttft", True)
    reason = (
        f"TTFT p99 {mine * 1000:.0f} ms against the baseline's {theirs * 1000:.0f} ms (more"
        f" than x{rule.ttft_p99_ratio:g} and {rule.ttft_min_excess_s * 1000:.0f} ms above)"
    )
    return _Found("ttft", False, True, reason)


def _errors(rule: CanaryRule, tally: Tally, base: Tally) -> _Found:
    if min(tally.requests, base.requests) < rule.min_requests:
        return _Found("errors", False)  # the TTFT check already says how few
    mine, theirs = tally.failed / tally.requests, base.failed / base.requests
    if mine - theirs <= rule.error_rate_excess:
        return _Found("errors", True)
    reason = (
        f"error rate {mine:.1%} against the baseline's {theirs:.1%} (more than"
        f" {rule.error_rate_excess * 100:g} points above)"
    )
    return _Found("errors", False, True, reason)


@dataclass(frozen=True)
class Reference:
    """The quality a variant is compared with, and whether only its scores of deterministic
    requests count (where the baseline is the gold)."""

    quality: float
    greedy_only: bool


def _quality(rule: CanaryRule, tally: Tally, reference: Reference | None) -> _Found:
    if not tally.qualities:
        return _Found("quality", True)  # not shadowed: nothing to hold a promotion back
    if reference is None:
        return _Found("quality", False, reason="no baseline quality to compare")
    scores = tally.greedy if reference.greedy_only else tally.qualities
    kind = "deterministic-request" if reference.greedy_only else "shadow"
    if len(scores) < rule.min_scores:
        return _Found("quality", False, reason=f"{len(scores)} of {rule.min_scores} {kind} scores")
    mine = _mean(scores)
    if reference.quality - mine <= rule.quality_drop:
        return _Found("quality", True)
    reason = (
        f"quality {mine:.2f} against the baseline's {reference.quality:.2f} (more than"
        f" {rule.quality_drop:g} below; {len(scores)} {kind} scores)"
    )
    return _Found("quality", False, True, reason)


def _too_few(what: str, mine: int, theirs: int, rule: CanaryRule) -> str:
    return f"{what}: {mine} here, {theirs} on the baseline, {rule.min_requests} needed on each"


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _evidence(
    name: str, tally: Tally, verdict: str, regressed: list[Check], reasons: list[str]
) -> VariantEvidence:
    p99 = quantile(tally.ttft, P99)
    return VariantEvidence.model_validate(
        {
            "variant": name,
            "answered": tally.answered,
            "failed": tally.failed,
            "ttft_p99_ms": None if p99 is None else round(p99 * 1000, 3),
            "error_rate": None if tally.requests == 0 else tally.failed / tally.requests,
            "quality": None if not tally.qualities else _mean(tally.qualities),
            "scores": len(tally.qualities),
            "verdict": verdict,
            "regressed": regressed,
            "reasons": reasons,
        }
    )


def rollback(
    rollout: ModelRollout, verdicts: ModelVerdicts, scheduler_id: str, now: float
) -> ModelRollout | None:
    """The rollout with every regressed variant that still has a share set to 0 and noted
    why; None when none has (nothing to write)."""
    base = verdicts.of(BASELINE)
    changed: list[Variant] = []
    out: list[Variant] = []
    for v in rollout.variants:
        found = verdicts.of(v.name)
        if v.percent > 0 and found is not None and found.verdict == "regressed":
            note = RolledBack(
                reason="; ".join(found.reasons[: len(found.regressed)]),
                checks=found.regressed,
                at=now,
                scheduler_id=scheduler_id,
                evidence=[found, *([] if base is None else [base])],
            )
            v = v.model_copy(update={"percent": 0.0, "rolled_back": note})
            changed.append(v)
        out.append(v)
    if not changed:
        return None
    # A copy: whatever else the rollout says (its shadow) stays as it was.
    return rollout.model_copy(update={"variants": out, "updated_at": now})
