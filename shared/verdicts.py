"""How a model's canaries compare with its baseline: the evidence of a sliding window and the
verdict on it, as the schedulers publish them (the verdicts topic) and note them on a
rolled-back variant (`Variant.rolled_back`). ADR 0058.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from shared.messages import Model

# What a variant is compared with its baseline on: TTFT p99, error rate, quality score.
Check = Literal["ttft", "errors", "quality"]
CHECKS: tuple[Check, ...] = ("quality", "errors", "ttft")
# ok: every check has its minimum sample and none regressed (a promotion may go ahead);
# too_few: no regression seen, but not enough evidence; regressed: a check past its
# threshold (the variant is rolled back); reference: the baseline itself.
Verdict = Literal["ok", "too_few", "regressed", "reference"]


class VariantEvidence(Model):
    """One variant's window (or the baseline's) and its verdict."""

    variant: str = Field(description="The variant's name; `baseline` for the baseline.")
    answered: int = Field(ge=0, description="Requests answered in the window.")
    failed: int = Field(ge=0, description="Requests failed (`internal`) in the window.")
    ttft_p99_ms: float | None = Field(
        default=None, description="TTFT p99 of the window's answers (None: none answered)."
    )
    error_rate: float | None = Field(
        default=None, ge=0.0, le=1.0, description="failed / (answered + failed); None: none."
    )
    quality: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Mean shadow quality score of the window (None: none scored).",
    )
    scores: int = Field(default=0, ge=0, description="Shadow scores in the window.")
    verdict: Verdict
    regressed: list[Check] = Field(default_factory=list, description="The checks it failed.")
    reasons: list[str] = Field(
        default_factory=list,
        description="Why, in words: each regression's numbers (in the order of `regressed`),"
        " then what evidence is still wanting.",
    )

    @property
    def requests(self) -> int:
        return self.answered + self.failed


class ModelVerdicts(Model):
    """On the verdicts topic (compacted, keyed by `model`): a scheduler's latest judgement of
    a model's variants against its baseline; written when a verdict changes, and every few
    seconds while nothing does."""

    model: str = Field(min_length=1, max_length=200)
    scheduler_id: str = Field(min_length=1, max_length=200)
    judged_at: float = Field(default_factory=time.time, description="Unix time, seconds.")
    window_s: float = Field(gt=0, description="The sliding window judged, seconds.")
    variants: list[VariantEvidence] = Field(
        default_factory=list, description="The baseline first, then each variant."
    )

    def of(self, variant: str) -> VariantEvidence | None:
        return next((v for v in self.variants if v.variant == variant), None)


class RolledBack(Model):
    """On a variant that a scheduler rolled back (its share set to 0): why, and when."""

    reason: str = Field(max_length=2000, description="Each failed check, in words.")
    checks: list[Check] = Field(min_length=1)
    at: float = Field(description="Unix time, seconds.")
    scheduler_id: str = Field(min_length=1, max_length=200)
    evidence: list[VariantEvidence] = Field(
        default_factory=list, description="The variant's window, then the baseline's."
    )
