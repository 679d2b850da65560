"""The canary judge's metrics: each variant's window as judged, its verdict, and rollbacks
(the Grafana dashboard's "Rollouts (variants)" row and the rollback alert read them)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from shared.verdicts import CHECKS, Check, ModelVerdicts, Verdict

# The verdict gauge's values: a regression below zero, so a graph shows it falling.
VERDICT_VALUES: dict[Verdict, float] = {"ok": 1.0, "too_few": 0.0, "regressed": -1.0}


@dataclass(frozen=True)
class CanaryMetrics:
    """Observes the judge; it never sends or rewrites. Caller: `CanaryJudge`."""

    rollbacks: Counter
    ttft_p99: Gauge
    error_rate: Gauge
    quality: Gauge
    requests: Gauge
    verdict: Gauge

    @classmethod
    def build(cls, registry: CollectorRegistry = REGISTRY) -> CanaryMetrics:
        labels = ["model", "variant"]
        return cls(
            Counter(
                "tokenbus_scheduler_rollbacks",
                "Variants this scheduler rolled back (share to 0) on a regression against"
                " their baseline, by the first check that failed (quality, errors, ttft).",
                ["model", "variant", "reason"],
                registry=registry,
            ),
            Gauge(
                "tokenbus_scheduler_variant_ttft_p99_seconds",
                "TTFT p99 of each variant's answers in the canary window (NaN: none).",
                labels,
                registry=registry,
            ),
            Gauge(
                "tokenbus_scheduler_variant_error_ratio",
                "Share of each variant's requests in the canary window that failed (NaN: none).",
                labels,
                registry=registry,
            ),
            Gauge(
                "tokenbus_scheduler_variant_quality_score",
                "Mean shadow quality score (agreement with the gold variant, 0-1) of each"
                " variant in the canary window (NaN: none scored).",
                labels,
                registry=registry,
            ),
            Gauge(
                "tokenbus_scheduler_variant_window_requests",
                "Requests each variant ended in the canary window (answered or failed).",
                labels,
                registry=registry,
            ),
            Gauge(
                "tokenbus_scheduler_variant_verdict",
                "Each variant's verdict against its baseline: 1 ok, 0 too few samples,"
                " -1 regressed.",
                labels,
                registry=registry,
            ),
        )

    def observe(self, verdicts: ModelVerdicts) -> None:
        """The model's latest verdicts."""
        for v in verdicts.variants:
            at = (verdicts.model, v.variant)
            ttft = math.nan if v.ttft_p99_ms is None else v.ttft_p99_ms / 1000.0
            self.ttft_p99.labels(*at).set(ttft)
            self.error_rate.labels(*at).set(math.nan if v.error_rate is None else v.error_rate)
            self.quality.labels(*at).set(math.nan if v.quality is None else v.quality)
            self.requests.labels(*at).set(v.requests)
            if v.verdict != "reference":
                self.verdict.labels(*at).set(VERDICT_VALUES[v.verdict])
                for check in CHECKS:  # shown at 0 first, so a rollback is an increase
                    self.rollbacks.labels(*at, check)

    def rolled_back(self, model: str, variant: str, checks: Sequence[Check]) -> None:
        self.rollbacks.labels(model, variant, checks[0]).inc()


@functools.cache
def canary_metrics() -> CanaryMetrics:
    return CanaryMetrics.build()
