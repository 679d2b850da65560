"""PNG plots of a report: latency against offered load, TTFT CDFs, batch size histograms."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import FuncFormatter, MaxNLocator

from bench.report import BenchReport, PolicyReport, RunSummary

COLOURS = {"batch1": "#d62728", "fixed": "#1f77b4", "adaptive": "#2ca02c", "direct": "#7f7f7f"}
FILES = ("latency_vs_load.png", "ttft_cdf.png", "batch_sizes.png")


def _ran(report: BenchReport) -> list[PolicyReport]:
    return [p for p in report.policies if p.available and p.runs]


def _colour(name: str) -> str | None:
    return COLOURS.get(name)


def reference_rate(report: BenchReport, preferred: float = 50.0) -> float | None:
    """The rate the CDF and histogram show: `preferred` if swept, else the sweep's middle."""
    rates = sorted({r.offered_rps for p in _ran(report) for r in p.runs})
    if not rates:
        return None
    return preferred if preferred in rates else rates[len(rates) // 2]


def _at(policy: PolicyReport, rate: float) -> RunSummary | None:
    return next((r for r in policy.runs if r.offered_rps == rate), None)


def latency_vs_load(report: BenchReport, path: Path, slo_ms: float) -> None:
    fig, (ttft, over, tput) = plt.subplots(1, 3, figsize=(15, 4.6))
    for p in _ran(report):
        runs = sorted(p.runs, key=lambda r: r.offered_rps)
        x = [r.offered_rps for r in runs]
        c = _colour(p.name)
        i = [r.tiers["interactive"].ttft_ms for r in runs]
        ttft.plot(x, [d.p99 for d in i], "o-", color=c, label=f"{p.name} p99")
        ttft.plot(x, [d.p50 for d in i], "o--", color=c, alpha=0.6, label=f"{p.name} p50")
        o = [r.tiers["all"].overhead_ms for r in runs]
        over.plot(x, [d.p99 for d in o], "o-", color=c, label=f"{p.name} p99")
        over.plot(x, [d.p50 for d in o], "o--", color=c, alpha=0.6, label=f"{p.name} p50")
        tput.plot(x, [r.output_tokens_per_s for r in runs], "o-", color=c, label=p.name)
    ttft.axhline(slo_ms, color="black", lw=0.8, ls=":", label=f"SLO {slo_ms:g} ms")
    ttft.set(
        title="Interactive TTFT vs offered load",
        xlabel="offered requests/s",
        ylabel="ms (log)",
        yscale="log",
    )
    over.set(
        title="Pipeline overhead (TTFT - engine - batch wait)",
        xlabel="offered requests/s",
        ylabel="ms (log)",
        yscale="log",
    )
    tput.set(title="Output tokens/s", xlabel="offered requests/s", ylabel="tokens/s")
    for ax in (ttft, over):
        _plain_log_ticks(ax, "y")
    for ax in (ttft, over, tput):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_subtitle(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ttft_cdf(report: BenchReport, path: Path, rate: float) -> None:
    tiers = ("interactive", "background")
    fig, axes = plt.subplots(1, len(tiers), figsize=(12, 4.4))
    for ax, tier in zip(axes, tiers, strict=True):
        for p in _ran(report):
            run = _at(p, rate)
            samples = run.ttft_samples_ms.get(tier, []) if run else []
            if not samples:
                continue
            y = [(k + 1) / len(samples) for k in range(len(samples))]
            ax.step(
                samples,
                y,
                where="post",
                color=_colour(p.name),
                label=f"{p.name} (n={len(samples)})",
            )
        ax.set(
            title=f"TTFT CDF, {tier}, {rate:g} req/s offered",
            xlabel="TTFT ms (log)",
            ylabel="share of requests",
            xscale="log",
            ylim=(0, 1.01),
        )
        _plain_log_ticks(ax, "x")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_subtitle(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def batch_sizes(report: BenchReport, path: Path, rate: float) -> None:
    ran = _ran(report)
    fig, axes = plt.subplots(
        1, max(1, len(ran)), figsize=(4.2 * max(1, len(ran)), 4.0), squeeze=False
    )
    for ax, p in zip(axes[0], ran, strict=False):
        run = _at(p, rate)
        if run is None or not run.batches.histogram:
            ax.set_title(f"{p.name}: no batch sizes seen", fontsize=9)
            continue
        bottom: dict[int, int] = {}
        for tier, hatch in (("interactive", ""), ("background", "//")):
            hist = {int(k): v for k, v in run.batches.histogram.get(tier, {}).items()}
            if not hist:
                continue
            x = sorted(hist)
            ax.bar(
                x,
                [hist[k] for k in x],
                bottom=[bottom.get(k, 0) for k in x],
                width=0.8,
                color=_colour(p.name),
                hatch=hatch,
                edgecolor="white",
                label=tier,
            )
            for k in x:
                bottom[k] = bottom.get(k, 0) + hist[k]
        what = (
            "scheduler batches"
            if run.batches.source == "scheduler"
            else "requests by engine batch at first token"
        )
        ax.set(
            title=f"{p.name} @ {rate:g}/s: {what}", xlabel="batch size", ylabel=run.batches.counts
        )
        ax.title.set_fontsize(9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(0, max(bottom) + 1)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_subtitle(report), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plain_log_ticks(ax: Axes, axis: str) -> None:
    """Log axes with plain numbers (50, 100, 200), not 5x10^1."""
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    target.set_minor_formatter(
        FuncFormatter(lambda v, _: f"{v:g}" if _leading(v) in (2, 5) else "")
    )


def _leading(v: float) -> int:
    if v <= 0:
        return 0
    return int(f"{v:e}"[0])


def _subtitle(report: BenchReport) -> str:
    m = report.machine
    return (
        f"sim profile {report.sim_profile}; {m.cores} cores ({m.cpu}); "
        f"load avg before {m.load_before[0]:.1f}; {report.created_at}"
    )


def draw_all(report: BenchReport, directory: Path, slo_ms: float) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / name for name in FILES]
    latency_vs_load(report, paths[0], slo_ms)
    rate = reference_rate(report)
    if rate is not None:
        ttft_cdf(report, paths[1], rate)
        batch_sizes(report, paths[2], rate)
    return [p for p in paths if p.exists()]
