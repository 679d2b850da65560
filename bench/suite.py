"""Rate sweeps: against one running deployment, or side by side on stacks the bench starts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench.findings import derive
from bench.loadgen import LoadConfig, LoadResult, ProgressLine, run_load, warm_up
from bench.observe import DeploymentObserver, ObservedBatch
from bench.openai_load import run_openai_load
from bench.policies import (
    GPU_PROFILE,
    POLICIES,
    EngineProfile,
    Policy,
    engine_profile,
    max_batch_sizes,
    unavailable_reason,
)
from bench.report import BenchReport, Machine, PolicyReport, RunSummary
from bench.stacks import DirectStack, PipelineStack, Stack, StackError, private_broker
from bench.summary import RunContext, summarise
from bench.workload import Mix, plan
from shared.settings import TokenbusSettings

DEFAULT_RATES = (10.0, 20.0, 35.0, 50.0, 75.0, 100.0, 200.0)
DEFAULT_POLICIES = ("batch1", "fixed", "adaptive", "direct")
# Client paths a sweep can drive: the WebSocket protocol, and the OpenAI-compatible API (SSE).
APIS = ("ws", "openai")
IDLE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class SweepOptions:
    rates: tuple[float, ...] = DEFAULT_RATES
    duration_s: float = 6.0
    connections: int = 8
    concurrency_cap: int = 256
    drain_s: float = 10.0
    seed: int = 7
    background_share: float | None = None
    mix_path: Path | None = None
    # Each is swept in turn on the same deployment; a non-WebSocket one is reported beside
    # it as `<policy>/<api>`.
    apis: tuple[str, ...] = ("ws",)

    def describe(self) -> str:
        return f"{self.mix_path or 'bench/data/mix.json'}: {self.mix().describe()}"

    def mix(self) -> Mix:
        mix = Mix.load(self.mix_path) if self.mix_path else Mix.load()
        return mix.with_background_share(self.background_share)


@dataclass(frozen=True)
class CompareOptions:
    sweep: SweepOptions = field(default_factory=SweepOptions)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    profile: str = GPU_PROFILE
    slo_ms: float = 500.0
    log_dir: Path = Path("bench/out/logs")
    command: str = ""
    # TOKENBUS_* settings given to every stack, over the profile's and the policy's.
    extra_env: dict[str, str] = field(default_factory=dict)


Say = Callable[[str], None]


async def sweep(
    policy: str,
    url: str,
    options: SweepOptions,
    *,
    max_batch: dict[str, int],
    no_batch_wait: bool = False,
    take_batches: Callable[[], list[ObservedBatch]] | None = None,
    wait_idle: Callable[[float], Awaitable[bool]] | None = None,
    say: Say = print,
    api: str = "ws",
) -> list[RunSummary]:
    """One open-loop run per rate, lowest first, each with its own (policy-independent) seed."""
    mix = options.mix()
    runs: list[RunSummary] = []
    for index, rate in enumerate(options.rates):
        # The same seed per rate for every policy: each faces the very same arrivals.
        seed = options.seed * 1000 + index
        planned = plan(mix, rate, options.duration_s, seed)
        config = LoadConfig(
            url,
            connections=options.connections,
            concurrency_cap=options.concurrency_cap,
            drain_s=options.drain_s,
            label=f"{policy} {rate:g}/s",
        )
        if take_batches is not None:
            take_batches()  # forget what earlier runs left
        result: LoadResult
        if api == "openai":
            result = await run_openai_load(config, planned, ProgressLine())
        else:
            result = await run_load(config, planned, ProgressLine())
        batches = take_batches() if take_batches is not None else None
        context = RunContext(policy, rate, options.duration_s, seed, max_batch, no_batch_wait)
        run = summarise(context, config, result, batches)
        runs.append(run)
        say(_one_line(run))
        if wait_idle is not None and not await wait_idle(IDLE_TIMEOUT_S):
            say(
                f"  warning: {policy} still busy {IDLE_TIMEOUT_S:.0f} s after the run at {rate:g}/s"
            )
    return runs


def _one_line(run: RunSummary) -> str:
    i = run.tiers["interactive"]
    return (
        f"  {run.policy:>8} {run.offered_rps:6g}/s  done {run.completed}/{run.sent} "
        f"({run.achieved_rps:.1f}/s, {run.output_tokens_per_s:.0f} tok/s)  interactive TTFT "
        f"p50 {_ms(i.ttft_ms.p50)} p99 {_ms(i.ttft_ms.p99)}  overhead p50 "
        f"{_ms(run.tiers['all'].overhead_ms.p50)}  errors {sum(run.errors.values())} "
        f"incomplete {run.incomplete} shed {run.shed}"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}ms"


async def against_running(
    url: str,
    options: SweepOptions,
    *,
    kafka: TokenbusSettings | None,
    max_batch: dict[str, int],
    command: str,
    say: Say = print,
) -> BenchReport:
    """`tokenbus bench run`: sweep a deployment someone else started (batches seen if `kafka`)."""
    began = time.monotonic()
    machine = machine_now()
    policies: list[PolicyReport] = []
    async with _observer(kafka) as observer:
        for api in options.apis:
            name = _named("target", api)
            runs = await sweep(
                name,
                url,
                options,
                max_batch=max_batch,
                take_batches=observer.take_batches if observer else None,
                say=say,
                api=api,
            )
            policies.append(
                PolicyReport(
                    name=name, kind="external", available=True, runs=runs, max_batch_size=max_batch
                )
            )
    return BenchReport(
        created_at=_now(),
        command=command,
        target=url,
        sim_profile="unknown (a running deployment)",
        workload=options.describe(),
        machine=machine.model_copy(update={"load_after": list(os.getloadavg())}),
        policies=policies,
        elapsed_s=round(time.monotonic() - began, 1),
    )


@contextlib.asynccontextmanager
async def _observer(kafka: TokenbusSettings | None) -> AsyncIterator[DeploymentObserver | None]:
    if kafka is None:
        yield None
        return
    observer = DeploymentObserver(kafka)
    await observer.start()
    try:
        yield observer
    finally:
        await observer.stop()


async def compare(options: CompareOptions, say: Say = print) -> BenchReport:
    """Every policy on its own fresh stack, the same sweep for each; then the findings."""
    began = time.monotonic()
    machine = machine_now()
    profile = engine_profile(options.profile)
    if profile.note:
        say(f"note: {profile.note}")
    chosen = [POLICIES[name] for name in options.policies]
    reports: list[PolicyReport] = []
    async with broker_if_needed(chosen, say) as bootstrap:
        for policy in chosen:
            reports.extend(await _run_policy(policy, profile, bootstrap, options, say))
    report = BenchReport(
        created_at=_now(),
        command=options.command,
        target="stacks started by the bench (127.0.0.1)",
        sim_profile=profile.name,
        sim_profile_note=profile.note,
        workload=options.sweep.describe(),
        machine=machine.model_copy(update={"load_after": list(os.getloadavg())}),
        policies=reports,
        elapsed_s=round(time.monotonic() - began, 1),
    )
    return report.model_copy(update={"findings": derive(report, options.slo_ms)})


def _named(policy: str, api: str) -> str:
    return policy if api == "ws" else f"{policy}/{api}"


async def _run_policy(
    policy: Policy, profile: EngineProfile, bootstrap: str | None, options: CompareOptions, say: Say
) -> list[PolicyReport]:
    """One report per API swept (`SweepOptions.apis`), all on the same stack."""
    env = {**profile.env, **policy.env, **options.extra_env}
    reason = unavailable_reason(policy)
    base = PolicyReport(
        name=policy.name,
        kind=policy.kind,
        available=reason is None,
        note=reason or policy.description,
        env=env,
    )
    if reason is not None:
        say(f"{policy.name}: not run: {reason}")
        return [base]
    max_batch = max_batch_sizes(policy, env)
    stack: Stack
    if policy.kind == "pipeline":
        assert bootstrap is not None
        stack = PipelineStack(policy.name, env, options.log_dir, bootstrap)
    else:
        stack = DirectStack(policy.name, env, options.log_dir)
    say(f"{policy.name}: starting ({policy.description})")
    try:
        try:
            await stack.start()
            await warm_up(stack.ws_url)
        except (StackError, TimeoutError, OSError) as exc:
            # One broken stack must not cost the other policies their runs; the report
            # says what failed and the command exits non-zero.
            say(f"{policy.name}: failed to start: {exc}")
            return [
                base.model_copy(
                    update={
                        "available": False,
                        "failed": True,
                        "note": f"failed to start: {str(exc)[:500]}",
                    }
                )
            ]
        observer = stack.observer
        # The direct baseline has no edge: only its WebSocket path exists.
        apis = ("ws",) if policy.kind == "direct" else options.sweep.apis
        reports = []
        for api in apis:
            runs = await sweep(
                _named(policy.name, api),
                stack.ws_url,
                options.sweep,
                max_batch=max_batch,
                no_batch_wait=policy.kind == "direct",
                take_batches=observer.take_batches if observer else None,
                wait_idle=stack.wait_idle,
                say=say,
                api=api,
            )
            name = _named(policy.name, api)
            reports.append(
                base.model_copy(update={"name": name, "runs": runs, "max_batch_size": max_batch})
            )
        stack.check_alive()
    finally:
        await stack.stop()
    return reports


@contextlib.asynccontextmanager
async def broker_if_needed(
    policies: list[Policy], say: Say, *, own: bool = False
) -> AsyncIterator[str | None]:
    """A broker for the pipeline stacks among `policies`, or None if there are none.

    `own`: a private one-node broker on free ports, so its CPU is the bench's alone; else
    KAFKA_BOOTSTRAP_SERVERS if set, else a local broker from the launcher, stopped after.
    """
    if not any(p.kind == "pipeline" and unavailable_reason(p) is None for p in policies):
        yield None
        return
    if own:
        async with private_broker(say) as bootstrap:
            yield bootstrap
        return
    given = TokenbusSettings().bootstrap_servers
    if "KAFKA_BOOTSTRAP_SERVERS" in os.environ or "TOKENBUS_BOOTSTRAP_SERVERS" in os.environ:
        yield given
        return
    from deploy.kafka import launcher

    broker = launcher.Cluster.resolve()
    say(f"starting a local Kafka broker on port {broker.port} (KAFKA_BOOTSTRAP_SERVERS unset)")
    _pid, owned = await asyncio.to_thread(launcher.start, broker)
    try:
        yield broker.bootstrap_servers
    finally:
        if owned:
            await asyncio.to_thread(launcher.stop, broker)


def machine_now() -> Machine:
    return Machine(
        platform=platform.platform(),
        python=platform.python_version(),
        cpu=_cpu_model(),
        cores=os.cpu_count() or 0,
        memory_gib=_memory_gib(),
        load_before=[round(v, 2) for v in os.getloadavg()],
    )


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    return None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
