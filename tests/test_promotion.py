"""The evidence a promotion needs (tokenbus/promotion.py): `tokenbus models rollout` raises a
variant's share only on a recent verdict with enough requests and no regression; a start
from 0 % and any lowering need none."""

from __future__ import annotations

from typing import Any

from shared.variants import Variant
from shared.verdicts import ModelVerdicts, RolledBack, VariantEvidence
from tokenbus.promotion import evidence_line, refusal

NOW = 1_000_000.0


def verdicts(verdict: str, reasons: list[str] | None = None, at: float = NOW - 2) -> ModelVerdicts:
    evidence: dict[str, Any] = {
        "variant": "fp8",
        "answered": 80,
        "failed": 1,
        "ttft_p99_ms": 120.0,
        "error_rate": 1 / 81,
        "quality": 0.97,
        "scores": 30,
        "verdict": verdict,
        "regressed": ["quality"] if verdict == "regressed" else [],
        "reasons": reasons or [],
    }
    return ModelVerdicts(
        model="m",
        scheduler_id="s1",
        judged_at=at,
        window_s=60,
        variants=[VariantEvidence.model_validate(evidence)],
    )


def test_lowering_a_share_never_needs_evidence() -> None:
    assert refusal("m", Variant(name="fp8", percent=20), 5, None, NOW) is None
    assert refusal("m", Variant(name="fp8", percent=20), 0, verdicts("regressed"), NOW) is None


def test_starting_a_canary_needs_none() -> None:
    assert refusal("m", None, 5, None, NOW) is None
    assert refusal("m", Variant(name="fp8", percent=0), 50, None, NOW) is None


def test_raising_a_rolled_back_variant_again_needs_force() -> None:
    note = RolledBack(
        reason="quality 0.50 against 1.00", checks=["quality"], at=NOW, scheduler_id="s"
    )
    why = refusal("m", Variant(name="fp8", percent=0, rolled_back=note), 5, verdicts("ok"), NOW)
    assert why is not None
    assert "was rolled back (quality 0.50 against 1.00)" in why
    assert "--force" in why


def test_a_raise_needs_a_recent_verdict() -> None:
    old = Variant(name="fp8", percent=5)
    assert "no recent verdict" in (refusal("m", old, 25, None, NOW) or "")
    stale = verdicts("ok", at=NOW - 600)
    assert "no recent verdict" in (refusal("m", old, 25, stale, NOW) or "")


def test_a_raise_goes_ahead_on_an_ok_verdict_only() -> None:
    old = Variant(name="fp8", percent=5)
    assert refusal("m", old, 25, verdicts("ok"), NOW) is None
    regressed = refusal("m", old, 25, verdicts("regressed", ["quality 0.5 below"]), NOW)
    assert regressed == "fp8 of m has regressed: quality 0.5 below"
    few = refusal("m", old, 25, verdicts("too_few", ["answers: 3 here"]), NOW)
    assert few is not None
    assert "not enough evidence" in few
    assert "answers: 3 here" in few


def test_the_evidence_line_shows_the_window() -> None:
    line = evidence_line(verdicts("ok").variants[0])
    assert line == (
        "requests 81  TTFT p99 120 ms  errors 1.2%  quality 0.97 (30 scores)  verdict: ok"
    )
