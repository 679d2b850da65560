"""The report as one table: a row per policy and offered rate, as text or as Markdown."""

from __future__ import annotations

from bench.report import BenchReport, Distribution, RunSummary

HEADERS = (
    "policy",
    "offered/s",
    "done/s",
    "tok/s",
    "int TTFT p50",
    "p95",
    "p99",
    "bg TTFT p50",
    "p99",
    "ITL p50",
    "TPOT p50",
    "int E2E p99",
    "overhead p50",
    "p99",
    "batch mean",
    "fill",
    "errors",
    "incompl.",
    "shed",
    "gen lag p99",
    "load 1m",
)


def rows(report: BenchReport) -> list[list[str]]:
    out: list[list[str]] = []
    for policy in report.policies:
        if not policy.available:
            note = policy.note.splitlines()[0][:100] if policy.note else ""
            out.append([policy.name, "not run: " + note] + [""] * (len(HEADERS) - 2))
            continue
        out.extend(_row(run) for run in policy.runs)
    return out


def _row(run: RunSummary) -> list[str]:
    i, b, a = run.tiers["interactive"], run.tiers["background"], run.tiers["all"]
    errors = ", ".join(f"{k} {v}" for k, v in sorted(run.errors.items())) or "0"
    return [
        run.policy,
        f"{run.offered_rps:g}",
        f"{run.achieved_rps:.1f}",
        f"{run.output_tokens_per_s:.0f}",
        _ms(i.ttft_ms, "p50"),
        _ms(i.ttft_ms, "p95"),
        _ms(i.ttft_ms, "p99"),
        _ms(b.ttft_ms, "p50"),
        _ms(b.ttft_ms, "p99"),
        _ms(a.itl_ms, "p50"),
        _ms(a.tpot_ms, "p50"),
        _ms(i.e2e_ms, "p99"),
        _ms(a.overhead_ms, "p50"),
        _ms(a.overhead_ms, "p99"),
        "-" if run.batches.size.mean is None else f"{run.batches.size.mean:.1f}",
        "-" if run.batches.fill.mean is None else f"{run.batches.fill.mean:.2f}",
        errors,
        str(run.incomplete),
        str(run.shed),
        _ms(run.generator_lag_ms, "p99"),
        f"{run.load_avg_1m:.1f}",
    ]


def _ms(d: Distribution, stat: str) -> str:
    value = getattr(d, stat)
    return "-" if value is None else f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def text(report: BenchReport) -> str:
    table = [list(HEADERS), *rows(report)]
    widths = [max(len(r[c]) for r in table if len(r[c]) < 40) for c in range(len(HEADERS))]
    lines = []
    for r in table:
        cells = [
            c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n(latencies in ms; int = interactive, bg = background)"


def markdown(report: BenchReport) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(report)]
    return "\n".join(lines)
