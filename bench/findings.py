"""The report's headline numbers, and the issue's targets checked against them."""

from __future__ import annotations

from bench.report import (
    BenchReport,
    Findings,
    OverheadPoint,
    PolicyReport,
    RunSummary,
    Saturation,
    SloResult,
    Target,
)

OVERHEAD_RATES = (50.0, 200.0)
OVERHEAD_P50_TARGET_MS = 5.0
OVERHEAD_P99_TARGET_MS = 20.0
BUS_RULE_GAIN_TARGET = 4.0
ADAPTIVE_LOW_LOAD_RATIO = 0.5
# "Matching" saturation throughput: within this share of the fixed rule's.
SATURATION_MATCH = 0.9
# A run fell behind when it answered less than this share of its offered rate.
BEHIND = 0.7


def passes_slo(run: RunSummary, slo_ms: float) -> bool:
    """Interactive p99 TTFT under the SLO, with every interactive request answered in full."""
    tier = run.tiers["interactive"]
    p99 = tier.ttft_ms.p99
    complete = tier.sent > 0 and tier.completed == tier.sent
    # An arrival refused by the client's concurrency cap also fails the rate.
    return p99 is not None and p99 < slo_ms and complete and run.shed == 0


def slo_result(policy: PolicyReport, slo_ms: float) -> SloResult:
    """Highest rate of the sweep's passing prefix: a rate above a failing one does not count."""
    highest: RunSummary | None = None
    failing: float | None = None
    for run in sorted(policy.runs, key=lambda r: r.offered_rps):
        if not passes_slo(run, slo_ms):
            failing = run.offered_rps
            break
        highest = run
    return SloResult(
        highest_passing_rps=highest.offered_rps if highest else None,
        first_failing_rps=failing,
        p99_at_highest_ms=highest.tiers["interactive"].ttft_ms.p99 if highest else None,
    )


def saturation_of(policy: PolicyReport) -> Saturation:
    best = max(policy.runs, key=lambda r: r.output_tokens_per_s)
    overloaded = any(
        r.shed or r.incomplete or r.achieved_rps < BEHIND * r.offered_rps for r in policy.runs
    )
    return Saturation(
        tokens_per_s=best.output_tokens_per_s, at_offered_rps=best.offered_rps, reached=overloaded
    )


def derive(report: BenchReport, slo_ms: float) -> Findings:
    ran = [p for p in report.policies if p.available and p.runs]
    overhead = {
        p.name: [
            OverheadPoint(
                offered_rps=r.offered_rps,
                p50_ms=r.tiers["all"].overhead_ms.p50,
                p99_ms=r.tiers["all"].overhead_ms.p99,
                completed=r.completed,
            )
            for r in p.runs
            if r.offered_rps in OVERHEAD_RATES
        ]
        for p in ran
    }
    slo = {p.name: slo_result(p, slo_ms) for p in ran}
    saturation = {p.name: saturation_of(p) for p in ran}
    low_load = {
        p.name: min(p.runs, key=lambda r: r.offered_rps).tiers["interactive"].ttft_ms.p50
        for p in ran
    }
    lowest_rate = min((r.offered_rps for p in ran for r in p.runs), default=None)
    targets = [
        *_overhead_targets(overhead.get("fixed", [])),
        _bus_rule_target(slo.get("fixed"), slo.get("batch1"), lowest_rate, slo_ms),
        _adaptive_latency_target(low_load.get("adaptive"), low_load.get("fixed")),
        _adaptive_throughput_target(saturation.get("adaptive"), saturation.get("fixed")),
    ]
    return Findings(
        slo_ttft_ms=slo_ms,
        overhead=overhead,
        slo=slo,
        saturation=saturation,
        low_load_ttft_p50_ms=low_load,
        targets=targets,
    )


def _overhead_targets(points: list[OverheadPoint]) -> list[Target]:
    at50 = next((p for p in points if p.offered_rps == 50.0), None)
    p50 = at50.p50_ms if at50 else None
    p99 = at50.p99_ms if at50 else None
    return [
        Target(
            name="pipeline overhead p50 at 50 req/s (fixed)",
            measured=_fmt_ms(p50),
            target=f"<= {OVERHEAD_P50_TARGET_MS:g} ms",
            holds=None if p50 is None else p50 <= OVERHEAD_P50_TARGET_MS,
        ),
        Target(
            name="pipeline overhead p99 at 50 req/s (fixed)",
            measured=_fmt_ms(p99),
            target=f"<= {OVERHEAD_P99_TARGET_MS:g} ms",
            holds=None if p99 is None else p99 <= OVERHEAD_P99_TARGET_MS,
        ),
    ]


def _bus_rule_target(
    fixed: SloResult | None, batch1: SloResult | None, lowest: float | None, slo_ms: float
) -> Target:
    name = f"bus rule rate at the SLO (interactive p99 TTFT < {slo_ms:g} ms) vs batch size 1"
    target = f">= {BUS_RULE_GAIN_TARGET:g}x"
    if fixed is None or batch1 is None:
        return Target(name=name, measured="not measured", target=target, holds=None)
    f, b = fixed.highest_passing_rps, batch1.highest_passing_rps
    if f is None:
        return Target(
            name=name, measured="fixed fails at every swept rate", target=target, holds=False
        )
    if b is None:
        # batch1 fails even the lowest rate: only a lower bound on the gain is known.
        bound = f / lowest if lowest else None
        measured = f"fixed {f:g}/s; batch1 fails at {lowest:g}/s: gain > {bound:.1f}x"
        holds = bound is not None and bound >= BUS_RULE_GAIN_TARGET
        return Target(name=name, measured=measured, target=target, holds=holds)
    gain = f / b
    return Target(
        name=name,
        measured=f"fixed {f:g}/s vs batch1 {b:g}/s: {gain:.2f}x (sweep resolution)",
        target=target,
        holds=gain >= BUS_RULE_GAIN_TARGET,
    )


def _adaptive_latency_target(adaptive: float | None, fixed: float | None) -> Target:
    name = "adaptive low-load interactive p50 TTFT vs fixed"
    target = f"<= {ADAPTIVE_LOW_LOAD_RATIO:g}x fixed"
    if adaptive is None or fixed is None:
        return Target(
            name=name, measured="not measured (needs adaptive and fixed)", target=target, holds=None
        )
    ratio = adaptive / fixed
    return Target(
        name=name,
        measured=f"{adaptive:.1f} ms vs {fixed:.1f} ms: {ratio:.2f}x",
        target=target,
        holds=ratio <= ADAPTIVE_LOW_LOAD_RATIO,
    )


def _adaptive_throughput_target(adaptive: Saturation | None, fixed: Saturation | None) -> Target:
    name = "adaptive saturation tokens/s vs fixed"
    target = f">= {SATURATION_MATCH:g}x fixed"
    if adaptive is None or fixed is None or fixed.tokens_per_s <= 0:
        return Target(
            name=name, measured="not measured (needs adaptive and fixed)", target=target, holds=None
        )
    ratio = adaptive.tokens_per_s / fixed.tokens_per_s
    measured = f"{adaptive.tokens_per_s:.0f} vs {fixed.tokens_per_s:.0f} tok/s: {ratio:.2f}x"
    if not (adaptive.reached and fixed.reached):
        # Below saturation both just carry the offered load: equal, and meaningless.
        return Target(
            name=name,
            measured=measured + ", sweep did not saturate both",
            target=target,
            holds=None,
        )
    return Target(name=name, measured=measured, target=target, holds=ratio >= SATURATION_MATCH)


def _fmt_ms(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.1f} ms"
