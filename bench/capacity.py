"""The capacity benchmark (`make bench`): how much the bus carries, and the CPU it costs.

Two parts, one run:

1. **Ceiling.** `fixed` (the pipeline) and `direct` (the engine behind a WebSocket) on the
   fast `constant` profile, where the engine never limits. Each climbs a rate ladder until
   interactive p99 TTFT reaches the SLO, then bisects between the last passing and first
   failing rate. Every run samples each process's CPU from `/proc` over that run alone.
2. **Overhead.** Both again on the `llama3-8b-h100` profile at one rate (50 req/s): TTFT
   minus the engine's time to first token minus the scheduler's batch wait.

Then the issue-12 targets are checked and the result is written as JSON, Markdown and a
stacked-bar plot of CPU per request by process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from aiokafka.errors import KafkaError
from pydantic import BaseModel, ConfigDict, Field

from bench.cpu import CpuSampler, CpuWindow, listening_pid, window
from bench.findings import passes_slo
from bench.loadgen import LoadConfig, ProgressLine, run_load, warm_up
from bench.policies import (
    GPU_PROFILE,
    POLICIES,
    EngineProfile,
    Policy,
    engine_profile,
    fast_constant_profile,
    max_batch_sizes,
)
from bench.report import Machine, RunSummary
from bench.stacks import ROOT, DirectStack, PipelineStack, Stack, StackError, private_broker
from bench.suite import machine_now
from bench.summary import RunContext, summarise
from bench.workload import Mix, plan

# The targets (issue 12, point 2).
CEILING_RATIO_TARGET = 0.6
CPU_PER_REQUEST_TARGET_MS = 0.5
CPU_PER_TOKEN_TARGET_US = 20.0
OVERHEAD_P50_TARGET_MS = 5.0
OVERHEAD_P99_TARGET_MS = 20.0
# The processes whose CPU the per-request target covers (the engine's is not).
SERVICE_PROCESSES = ("edge", "ingest", "scheduler", "worker")
IDLE_TIMEOUT_S = 20.0

Say = Callable[[str], None]


@dataclass(frozen=True)
class CapacityOptions:
    policies: tuple[str, ...] = ("fixed", "direct")
    # Up to 1600: `direct` passed 800 on two cores, so a ladder ending there gave only a
    # bound of the ceiling ratio, not the ratio.
    ladder: tuple[float, ...] = (25.0, 50.0, 100.0, 200.0, 400.0, 800.0, 1600.0)
    refine_steps: int = 2  # bisections between the last passing and the first failing rate
    duration_s: float = 6.0
    drain_s: float = 10.0
    connections: int = 8
    concurrency_cap: int = 512
    slo_ms: float = 500.0
    overhead_rate: float = 50.0
    overhead_duration_s: float = 10.0
    # The same load first, not counted, in windows as long as the counted one: the overhead
    # is a steady state's, not a fresh stack's first seconds (its connections, the broker's
    # first fetches of its topics, caches). On one stack, 10 s windows at 50 req/s fell from
    # 5.4-9.5 ms (p50) in the first to 4.4-5.0 from the third on (ADR 0042). Each window's
    # figures are reported beside the counted ones.
    overhead_warmup_s: float = 30.0
    overhead_profile: str = GPU_PROFILE
    own_broker: bool = True  # a private broker: its CPU is this run's alone
    idle_s: float = 5.0  # CPU with no load, measured before the climb
    seed: int = 7
    log_dir: Path = Path("bench/out/logs")
    source: Path = ROOT  # whose services run (another checkout compares a commit)
    command: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)


QUICK = {
    "ladder": (10.0, 20.0),
    "refine_steps": 0,
    "duration_s": 3.0,
    "drain_s": 5.0,
    "overhead_rate": 10.0,
    "overhead_duration_s": 3.0,
    "overhead_warmup_s": 0.0,
    "own_broker": False,
    "idle_s": 1.0,
}


# --- the report ---------------------------------------------------------------------------


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CapacityRun(Model):
    """One open-loop run: what the clients saw, and the CPU every process spent on it."""

    run: RunSummary
    cpu: CpuWindow
    passed: bool = Field(description="Interactive p99 TTFT under the SLO, all answered.")


class CapacityPolicy(Model):
    name: str
    kind: str
    env: dict[str, str]
    failed: str = ""  # why it did not run to the end, if it did not
    runs: list[CapacityRun] = Field(default_factory=list)
    ceiling_rps: float | None = Field(description="Highest passing rate below the first failing.")
    first_failing_rps: float | None
    tokens_per_s_at_ceiling: float | None
    cpu_rps: float | None = Field(
        description="The run whose CPU is reported: the ceiling, else the lowest rate run."
    )
    cpu: CpuWindow | None
    idle: CpuWindow | None = Field(
        default=None, description="The same processes with no load, just before the climb."
    )


class OverheadWindow(Model):
    duration_s: float
    completed: int
    p50_ms: float | None
    p99_ms: float | None


class OverheadResult(Model):
    policy: str
    profile: str
    offered_rps: float
    completed: int
    p50_ms: float | None
    p99_ms: float | None
    warmup: list[OverheadWindow] = Field(
        default_factory=list, description="The uncounted windows run before, in order."
    )
    failed: str = ""


class TargetCheck(Model):
    name: str
    measured: str
    wanted: str
    met: bool | None = Field(description="None: not measured.")
    by: str = Field(description="How far from the target, either way.")


class CapacityReport(Model):
    created_at: str
    command: str
    commit_source: str
    machine: Machine
    broker: str
    slo_ms: float
    fast_profile: dict[str, str]
    workload: str
    duration_s: float
    policies: list[CapacityPolicy]
    overhead: list[OverheadResult]
    targets: list[TargetCheck]
    elapsed_s: float


# --- running ------------------------------------------------------------------------------


def next_rate(passed: dict[float, bool], ladder: tuple[float, ...], refine: int) -> float | None:
    """The next rate to run given the results so far, or None when the ceiling is found.

    Up the ladder while runs pass; after the first failure, `refine` bisections between the
    highest passing rate below it (or 0) and it.
    """
    failing = sorted(r for r, ok in passed.items() if not ok)
    if not failing:
        higher = [r for r in ladder if r not in passed]
        return higher[0] if higher else None
    first_fail = failing[0]
    below = [r for r, ok in passed.items() if ok and r < first_fail]
    low = max(below, default=0.0)
    refined = sum(1 for r in passed if r not in ladder)
    if refined >= refine or first_fail - low < 2.0:
        return None
    return round((low + first_fail) / 2, 1)


def ceiling(runs: list[CapacityRun]) -> tuple[CapacityRun | None, float | None]:
    """The highest passing run below the lowest failing rate, and that failing rate."""
    failing = min((r.run.offered_rps for r in runs if not r.passed), default=None)
    passing = [r for r in runs if r.passed and (failing is None or r.run.offered_rps < failing)]
    best = max(passing, key=lambda r: r.run.offered_rps, default=None)
    return best, failing


async def measured_run(
    stack: Stack,
    policy: Policy,
    rate: float,
    duration_s: float,
    options: CapacityOptions,
    max_batch: dict[str, int],
    broker_pid: int | None,
    index: int,
    say: Say,
) -> tuple[RunSummary, CpuWindow]:
    seed = options.seed * 1000 + index
    planned = plan(Mix.load(), rate, duration_s, seed)
    config = LoadConfig(
        stack.ws_url,
        connections=options.connections,
        concurrency_cap=options.concurrency_cap,
        drain_s=options.drain_s,
        label=f"{policy.name} {rate:g}/s",
    )
    pids = dict(stack.pids)
    if broker_pid is not None:
        pids["broker"] = broker_pid
    observer = stack.observer
    if observer is not None:
        observer.take_batches()  # forget what earlier runs left
    sampler = CpuSampler(pids, stack.worker_metrics_url)
    before = sampler.read()
    result = await run_load(config, planned, ProgressLine())
    after = sampler.read()
    batches = observer.take_batches() if observer is not None else None
    # The worker publishes its engine counter with each heartbeat: read it once a heartbeat
    # sent after the run has come (the engine is idle by then, so it adds nothing).
    if not await stack.wait_idle(IDLE_TIMEOUT_S):
        say(f"  warning: {policy.name} busy {IDLE_TIMEOUT_S:g} s after {rate:g}/s")
    after = sampler.engine_caught_up(after)
    context = RunContext(policy.name, rate, duration_s, seed, max_batch, policy.kind == "direct")
    run = summarise(context, config, result, batches)
    sent = sum(1 for t in result.traces if t.sent_at is not None)
    tokens = sum(t.completion_tokens or 0 for t in result.traces if t.completed)
    return run, window(before, after, run.completed, tokens, sent=sent)


async def idle_cpu(stack: Stack, broker_pid: int | None, options: CapacityOptions) -> CpuWindow:
    """What each process spends with nothing to do (polls, heartbeats, timers)."""
    pids = dict(stack.pids) | ({"broker": broker_pid} if broker_pid is not None else {})
    sampler = CpuSampler(pids, stack.worker_metrics_url)
    before = sampler.read()
    await asyncio.sleep(options.idle_s)
    return window(before, sampler.read(), 0, 0)


@contextlib.asynccontextmanager
async def started(
    policy: Policy, env: dict[str, str], options: CapacityOptions, bootstrap: str | None
) -> AsyncIterator[Stack]:
    stack: Stack
    if policy.kind == "pipeline":
        assert bootstrap is not None
        stack = PipelineStack(policy.name, env, options.log_dir, bootstrap, source=options.source)
    else:
        stack = DirectStack(policy.name, env, options.log_dir)
    try:
        await stack.start()
        await warm_up(stack.ws_url)
        yield stack
        stack.check_alive()
    finally:
        await stack.stop()


async def climb(
    policy: Policy,
    profile: EngineProfile,
    options: CapacityOptions,
    bootstrap: str | None,
    broker_pid: int | None,
    say: Say,
) -> CapacityPolicy:
    env = {**profile.env, **policy.env, **options.extra_env}
    runs: list[CapacityRun] = []
    failed = ""
    idle: CpuWindow | None = None
    say(f"{policy.name}: climbing ({policy.description})")
    try:
        async with started(policy, env, options, bootstrap) as stack:
            broker_of_stack = broker_pid if policy.kind == "pipeline" else None
            idle = await idle_cpu(stack, broker_of_stack, options)
            max_batch = max_batch_sizes(policy, env)
            passed: dict[float, bool] = {}
            while (rate := next_rate(passed, options.ladder, options.refine_steps)) is not None:
                run, cpu = await measured_run(
                    stack,
                    policy,
                    rate,
                    options.duration_s,
                    options,
                    max_batch,
                    broker_of_stack,
                    len(runs),
                    say,
                )
                ok = passes_slo(run, options.slo_ms)
                passed[rate] = ok
                runs.append(CapacityRun(run=run, cpu=cpu, passed=ok))
                say(_one_line(run, cpu, ok))
    except (StackError, TimeoutError, OSError, KafkaError) as exc:
        failed = str(exc)[:500]
        say(f"{policy.name}: failed: {failed}")
    best, failing = ceiling(runs)
    reference = best or min(runs, key=lambda r: r.run.offered_rps, default=None)
    return CapacityPolicy(
        name=policy.name,
        kind=policy.kind,
        env=env,
        failed=failed,
        runs=runs,
        ceiling_rps=best.run.offered_rps if best else None,
        first_failing_rps=failing,
        tokens_per_s_at_ceiling=best.run.output_tokens_per_s if best else None,
        cpu_rps=reference.run.offered_rps if reference else None,
        cpu=reference.cpu if reference else None,
        idle=idle,
    )


async def overhead_at(
    policy: Policy, options: CapacityOptions, bootstrap: str | None, say: Say
) -> OverheadResult:
    profile = engine_profile(options.overhead_profile)
    env = {**profile.env, **policy.env, **options.extra_env}
    base = OverheadResult(
        policy=policy.name,
        profile=profile.name,
        offered_rps=options.overhead_rate,
        completed=0,
        p50_ms=None,
        p99_ms=None,
    )
    warmup: list[OverheadWindow] = []
    try:
        async with started(policy, env, options, bootstrap) as stack:

            async def at_rate(duration_s: float, index: int) -> RunSummary:
                run, _ = await measured_run(
                    stack,
                    policy,
                    options.overhead_rate,
                    duration_s,
                    options,
                    max_batch_sizes(policy, env),
                    None,
                    index,
                    say,
                )
                return run

            for index, duration_s in enumerate(warmup_windows(options), start=90):
                w = (await at_rate(duration_s, index)).tiers["all"]
                warmup.append(
                    OverheadWindow(
                        duration_s=duration_s,
                        completed=w.completed,
                        p50_ms=w.overhead_ms.p50,
                        p99_ms=w.overhead_ms.p99,
                    )
                )
            run = await at_rate(options.overhead_duration_s, 100)
    except (StackError, TimeoutError, OSError, KafkaError) as exc:
        say(f"{policy.name} on {profile.name}: failed: {exc}")
        return base.model_copy(update={"failed": str(exc)[:500], "warmup": warmup})
    o = run.tiers["all"].overhead_ms
    before = ", ".join(_ms(w.p50_ms) for w in warmup)
    say(
        f"  {policy.name} on {profile.name} at {options.overhead_rate:g}/s: overhead "
        f"p50 {_ms(o.p50)} p99 {_ms(o.p99)} ({run.completed} requests"
        + (f"; warm-up windows before, p50: {before})" if warmup else ")")
    )
    return base.model_copy(
        update={"completed": run.completed, "p50_ms": o.p50, "p99_ms": o.p99, "warmup": warmup}
    )


def warmup_windows(options: CapacityOptions) -> list[float]:
    """The warm-up split into windows as long as the counted run (the last one shorter)."""
    left, windows = options.overhead_warmup_s, []
    while left > 1e-9:
        windows.append(min(left, options.overhead_duration_s))
        left -= windows[-1]
    return windows


@contextlib.asynccontextmanager
async def broker(options: CapacityOptions, say: Say) -> AsyncIterator[tuple[str, str]]:
    """Bootstrap servers, and a description of the broker for the report."""
    if options.own_broker:
        async with private_broker(say) as bootstrap:
            yield bootstrap, "private (started by the bench; its CPU is this run's alone)"
        return
    from shared.settings import TokenbusSettings

    given = TokenbusSettings().bootstrap_servers
    yield given, f"shared at {given}: its CPU includes whatever else uses it"


async def capacity(options: CapacityOptions, say: Say = print) -> CapacityReport:
    began = time.monotonic()
    machine = machine_now()
    fast = fast_constant_profile()
    chosen = [POLICIES[name] for name in options.policies]
    async with broker(options, say) as (bootstrap, broker_note):
        port = int(bootstrap.split(",")[0].rsplit(":", 1)[1])
        broker_pid = listening_pid(port)
        if broker_pid is None:
            broker_note += "; its process was not found, so its CPU is not reported"
        policies = [await climb(p, fast, options, bootstrap, broker_pid, say) for p in chosen]
        say(f"overhead at {options.overhead_rate:g} req/s on {options.overhead_profile}")
        overhead = [await overhead_at(p, options, bootstrap, say) for p in chosen]
    report = CapacityReport(
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        command=options.command,
        commit_source=source_commit(options.source),
        machine=machine.model_copy(update={"load_after": [round(v, 2) for v in os.getloadavg()]}),
        broker=broker_note,
        slo_ms=options.slo_ms,
        fast_profile=fast.env,
        workload=Mix.load().describe(),
        duration_s=options.duration_s,
        policies=policies,
        overhead=overhead,
        targets=[],
        elapsed_s=round(time.monotonic() - began, 1),
    )
    return report.model_copy(update={"targets": check_targets(report)})


def source_commit(source: Path) -> str:
    """Whose services ran: the checkout's commit, or the directory if it is not one."""
    try:
        found = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=source,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"{source} (not a git checkout)"
    return found if source == ROOT else f"{found} ({source})"


# --- the targets --------------------------------------------------------------------------


def service_cpu_ms(cpu: CpuWindow) -> float | None:
    """Edge + ingest + scheduler + worker (engine apart where measured) CPU per request."""
    parts = [cpu.processes[p].ms_per_request for p in SERVICE_PROCESSES if p in cpu.processes]
    if len(parts) != len(SERVICE_PROCESSES) or any(v is None for v in parts):
        return None
    return sum(v for v in parts if v is not None)


def check_targets(report: CapacityReport) -> list[TargetCheck]:
    by_name = {p.name: p for p in report.policies}
    pipeline, direct = by_name.get("fixed"), by_name.get("direct")
    checks = [_ceiling_check(pipeline, direct), _cpu_check(pipeline)]
    fixed_overhead = next((o for o in report.overhead if o.policy == "fixed"), None)
    for name, value, target in (
        ("p50", fixed_overhead.p50_ms if fixed_overhead else None, OVERHEAD_P50_TARGET_MS),
        ("p99", fixed_overhead.p99_ms if fixed_overhead else None, OVERHEAD_P99_TARGET_MS),
    ):
        rate = fixed_overhead.offered_rps if fixed_overhead else 0.0
        profile = fixed_overhead.profile if fixed_overhead else "-"
        checks.append(
            TargetCheck(
                name=f"pipeline overhead {name} at {rate:g} req/s ({profile})",
                measured=_ms(value),
                wanted=f"<= {target:g} ms",
                met=None if value is None else value <= target,
                by=_by(value, target),
            )
        )
    return checks


def _ceiling_check(pipeline: CapacityPolicy | None, direct: CapacityPolicy | None) -> TargetCheck:
    check = TargetCheck(
        name="pipeline ceiling / direct ceiling, output tokens/s",
        measured="-",
        wanted=f">= {CEILING_RATIO_TARGET:g}",
        met=None,
        by="-",
    )
    if pipeline is None or direct is None or not pipeline.runs or not direct.runs:
        return check
    # No passing rate at all: the ceiling is below the lowest rate tried, taken as 0.
    p = pipeline.tokens_per_s_at_ceiling or 0.0
    d = direct.tokens_per_s_at_ceiling
    if not d:
        return check.model_copy(update={"measured": "direct passed no rate"})
    ratio = p / d
    below = (
        ""
        if pipeline.ceiling_rps
        else ", none of its rates passed (lowest tried: "
        + (f"{min(r.run.offered_rps for r in pipeline.runs):g} req/s)")
    )
    return check.model_copy(
        update={
            "measured": f"{ratio:.2f} ({p:.0f} / {d:.0f} tokens/s{below})",
            "met": ratio >= CEILING_RATIO_TARGET,
            "by": f"{ratio / CEILING_RATIO_TARGET:.2f}x of the target",
        }
    )


def _cpu_check(pipeline: CapacityPolicy | None) -> TargetCheck:
    cpu = pipeline.cpu if pipeline else None
    measured = service_cpu_ms(cpu) if cpu else None
    if pipeline is None or cpu is None or measured is None or not cpu.requests:
        return TargetCheck(
            name="edge+ingest+scheduler+worker CPU per request",
            measured="-",
            wanted=f"<= {CPU_PER_REQUEST_TARGET_MS:g} ms + {CPU_PER_TOKEN_TARGET_US:g} µs/token",
            met=None,
            by="-",
        )
    per_request_tokens = cpu.output_tokens / cpu.requests
    budget = CPU_PER_REQUEST_TARGET_MS + CPU_PER_TOKEN_TARGET_US / 1000 * per_request_tokens
    engine = "engine apart" if "engine" in cpu.processes else "engine included: not measured apart"
    where = "the ceiling" if pipeline.ceiling_rps is not None else "its lowest rate (no ceiling)"
    return TargetCheck(
        name=f"edge+ingest+scheduler+worker CPU per request at {where}, "
        f"{pipeline.cpu_rps:g} req/s ({engine})",
        measured=f"{measured:.2f} ms ({per_request_tokens:.0f} output tokens/request)",
        wanted=f"<= {budget:.2f} ms ({CPU_PER_REQUEST_TARGET_MS:g} ms + "
        f"{CPU_PER_TOKEN_TARGET_US:g} µs x {per_request_tokens:.0f} tokens)",
        met=measured <= budget,
        by=_by(measured, budget),
    )


def _by(value: float | None, limit: float) -> str:
    """How far `value` is from an upper `limit`: 'missed by 2.4x (+7.0)' or 'met, 40% under'."""
    if value is None:
        return "-"
    if value <= limit:
        return f"met, {(1 - value / limit):.0%} under"
    return f"missed by {value / limit:.1f}x (+{value - limit:.2f})"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _one_line(run: RunSummary, cpu: CpuWindow, ok: bool) -> str:
    i = run.tiers["interactive"]
    services = service_cpu_ms(cpu)
    return (
        f"  {run.policy:>7} {run.offered_rps:6g}/s {'pass' if ok else 'FAIL'}  done "
        f"{run.completed}/{run.sent} ({run.output_tokens_per_s:.0f} tok/s)  interactive TTFT p99 "
        f"{_ms(i.ttft_ms.p99)}  CPU/request: "
        + ", ".join(
            f"{k} {v.ms_per_request:.2f}"
            for k, v in cpu.processes.items()
            if v.ms_per_request is not None
        )
        + (f" (services {services:.2f} ms)" if services is not None else "")
        + f"  load {cpu.load_average[0]:.1f}"
    )
