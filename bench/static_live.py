"""The static benchmark's live part: batch size 1 against the bus rule on real stacks.

`tokenbus bench static --live`. One stack per policy, both up at once, on the broker in
KAFKA_BOOTSTRAP_SERVERS, else a private one: edge, ingest, scheduler and `static.WORKERS`
workers in TOKENBUS_WORKER_BATCH_MODE=static on the `llama3-8b-h100` sim profile, each its
own id and batches partition, the same slots as the simulation (bench/static.py). Each
policy climbs open-loop Poisson rates (bench/loadgen.py), the two climbs taking turns run
by run, anchored on its simulated ceiling, until interactive p99 TTFT reaches the SLO or a
request goes unanswered, then bisects between the highest passing and the lowest failing
rate (as bench/capacity.py's climb does). Its ceiling is the highest passing rate; the
ratio of the two ceilings is issue 14's bus-rule target, with the simulation's beside it
as the prediction.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import static
from bench.cpu import cpu_seconds
from bench.findings import passes_slo
from bench.loadgen import LoadConfig, run_load, warm_up
from bench.stacks import PipelineStack, StackError, private_broker
from bench.summary import RunContext, summarise
from bench.workload import LengthDistribution, Mix, RequestClass, plan
from services.worker.engines.sim_profiles import sim_profile
from shared.messages import Tier

DURATION_S = 10.0  # arrivals per run: short, so the whole `make bench-static` stays ~5 min
WARM_S = 3.0  # unmeasured load at the ladder's first rate: a fresh stack's first seconds lag
DRAIN_S = 6.0  # after the last arrival; a request still unanswered then fails the rate
IDLE_TIMEOUT_S = 20.0  # between runs: the backlog of a failing rate must not leak on
CONNECTIONS = 4
# The climb: these shares of the simulated ceiling, up while runs pass...
LADDER = (0.5, 0.75, 1.0, 1.25, 1.5)
# ...then this many bisections between the highest passing and the lowest failing rate,
REFINE_STEPS = 2
# ...stopping sooner once the two are this close (share of the passing rate).
RESOLUTION = 0.1
# A failing rate is run again (other arrivals) before it counts as failed: on a shared
# machine one stall of a process (another job's burst) otherwise sets the ceiling.
TRIES = 2
WORKERS_TIMEOUT_S = 30.0  # every worker heard by the scheduler before the load

Say = Callable[[str], None]


@dataclass
class LiveRun:
    """One rate on one stack: what the clients saw, and the simulation's p99 there."""

    policy: str
    rate: float
    sent: int
    answered: int
    ttft_ms_p50: float
    ttft_ms_p99: float
    passed: bool
    batch_size_mean: float  # batches seen on the batches topic
    batches: int
    hops_ms_p50: dict[str, float]  # TTFT cut at each service's stamp (bench/stats.py HOPS)
    hops_ms_p99: dict[str, float]
    load_avg_1m: float
    cores: dict[str, float]  # CPU seconds per second of the run: edge, ingest, ..., loadgen
    predicted_ttft_ms_p99: float  # the simulation's: same policy, rate and workers


@dataclass
class LiveClimb:
    policy: str
    workers: int
    simulated_ceiling_rps: float
    ceiling_rps: float  # highest passing rate below the lowest failing; 0: none passed
    first_failing_rps: float | None
    runs: list[LiveRun] = field(default_factory=list)
    failed: str = ""  # why the climb stopped early, if it did


def mix() -> Mix:
    """The benchmark's interactive requests: prompts ~32-512 tokens, answers 16-64."""
    corpus = Mix.load().corpus
    return Mix(
        description="bench static: short interactive prompts and answers",
        classes=[
            RequestClass(
                name="static-chat",
                tier=Tier.interactive,
                weight=1.0,
                shape="prompt",
                prompt_tokens=LengthDistribution(median=128, sigma=0.7, min=32, max=512),
                max_tokens=LengthDistribution(median=32, sigma=0.4, min=16, max=64),
            )
        ],
        corpus=corpus,
    )


def env(policy: str) -> dict[str, str]:
    settings = {
        "TOKENBUS_WORKER_ENGINE": "sim",
        "TOKENBUS_WORKER_SIM_PROFILE": static.PROFILE,
        "TOKENBUS_WORKER_BATCH_MODE": "static",
        "TOKENBUS_WORKER_MAX_NUM_SEQS": str(static.SLOTS),
    }
    for key, value in static.POLICIES[policy].settings.items():
        settings[f"TOKENBUS_{key.upper()}"] = str(value)
    return settings


def next_rate(
    passed: dict[float, bool], ladder: tuple[float, ...], refine: int = REFINE_STEPS
) -> float | None:
    """The next rate to run, or None when the ceiling is found (bench/capacity.py's rule,
    with a relative resolution: these rates are a few req/s, not hundreds)."""
    failing = sorted(r for r, ok in passed.items() if not ok)
    if not failing:
        higher = [r for r in ladder if r not in passed]
        return higher[0] if higher else None
    first_fail = failing[0]
    low = max((r for r, ok in passed.items() if ok and r < first_fail), default=0.0)
    refined = sum(1 for r in passed if r not in ladder)
    if refined >= refine or first_fail - low <= RESOLUTION * max(low, first_fail / 2):
        return None
    return round((low + first_fail) / 2, 2)


def ceiling(runs: list[LiveRun]) -> tuple[float, float | None]:
    """The highest passing rate below the lowest failing one (0 if none), and that one.

    A rate passes when any run at it passed (a failure is run again: `TRIES`).
    """
    ok: dict[float, bool] = {}
    for r in runs:
        ok[r.rate] = ok.get(r.rate, False) or r.passed
    failing = min((rate for rate, good in ok.items() if not good), default=None)
    passing = [rate for rate, good in ok.items() if good and (failing is None or rate < failing)]
    return max(passing, default=0.0), failing


def predicted_p99(policy: str, rate: float, seconds: float) -> float:
    profile = sim_profile(static.PROFILE, max_num_seqs=static.SLOTS, token_rate=50.0)
    return static.simulate(static.POLICIES[policy], profile, rate, seconds).ttft_ms_p99


async def measured_run(
    stack: PipelineStack, policy: str, rate: float, index: int, sim_seconds: float
) -> LiveRun:
    seed = static.SEED * 1000 + index
    planned = plan(mix(), rate, DURATION_S, seed=seed)
    config = LoadConfig(
        stack.ws_url, connections=CONNECTIONS, drain_s=DRAIN_S, label=f"{policy} {rate:g}/s"
    )
    assert stack.observer is not None
    stack.observer.take_batches()  # forget what earlier runs left
    pids = {**stack.pids, "loadgen": os.getpid()}
    before = {key: cpu_seconds(pid) for key, pid in pids.items()}
    result = await run_load(config, planned)
    cpu = _cores(pids, before, result.ended_at - result.started_at)
    batches = stack.observer.take_batches()
    context = RunContext(policy, rate, DURATION_S, seed, {"interactive": static.SLOTS})
    run = summarise(context, config, result, batches)
    await stack.wait_idle(IDLE_TIMEOUT_S)
    tier = run.tiers["interactive"]
    # The percentiles passes_slo judges by; a request unanswered within the drain puts the
    # p99 past any SLO.
    p50 = tier.ttft_ms.p50 if tier.ttft_ms.p50 is not None else math.inf
    p99 = tier.ttft_ms.p99 if tier.ttft_ms.p99 is not None else math.inf
    if tier.completed < tier.sent:
        p99 = math.inf
    return LiveRun(
        policy=policy,
        rate=rate,
        sent=tier.sent,
        answered=tier.completed,
        ttft_ms_p50=round(p50, 1),
        ttft_ms_p99=round(p99, 1),
        passed=passes_slo(run, static.SLO_MS),
        batch_size_mean=round(run.batches.size.mean or 0.0, 2),
        batches=run.batches.batches,
        hops_ms_p50={k: round(v.p50, 1) for k, v in tier.hops_ms.items() if v.p50 is not None},
        hops_ms_p99={k: round(v.p99, 1) for k, v in tier.hops_ms.items() if v.p99 is not None},
        load_avg_1m=run.load_avg_1m,
        cores=cpu,
        predicted_ttft_ms_p99=predicted_p99(policy, rate, sim_seconds),
    )


class Climber:
    """One policy's stack and climb; `step` runs its next rate (its retries included)."""

    def __init__(
        self, policy: str, simulated: float, bootstrap: str, log_dir: Path, sim_seconds: float
    ) -> None:
        self.policy = policy
        self.ladder = tuple(round(share * simulated, 2) for share in LADDER)
        self.stack = PipelineStack(
            f"static{policy}", env(policy), log_dir, bootstrap, workers=static.WORKERS
        )
        self.sim_seconds = sim_seconds
        self.passed: dict[float, bool] = {}
        self.out = LiveClimb(policy, static.WORKERS, simulated, 0.0, None)
        self.done = False

    async def start(self) -> None:
        await self.stack.start()
        await _all_workers_heard(self.stack)
        await warm_up(self.stack.ws_url)
        warm = plan(mix(), self.ladder[0], WARM_S, seed=static.SEED)
        url = self.stack.ws_url
        await run_load(LoadConfig(url, connections=CONNECTIONS, drain_s=DRAIN_S), warm)
        await self.stack.wait_idle(IDLE_TIMEOUT_S)

    async def step(self, say: Say) -> None:
        rate = next_rate(self.passed, self.ladder)
        if rate is None:
            self.done = True
            return
        for _ in range(TRIES):
            run = await measured_run(
                self.stack, self.policy, rate, len(self.out.runs), self.sim_seconds
            )
            self.out.runs.append(run)
            say(_one_line(run))
            if run.passed:
                break
        self.passed[rate] = run.passed
        self.stack.check_alive()

    def fail(self, exc: BaseException, say: Say) -> None:
        self.out.failed = str(exc)[:500]
        self.done = True
        say(f"live {self.policy}: failed: {self.out.failed}")

    def result(self) -> LiveClimb:
        self.out.ceiling_rps, self.out.first_failing_rps = ceiling(self.out.runs)
        return self.out


async def climb_in_turn(climbers: list[Climber], say: Say) -> list[LiveClimb]:
    """One stack up at a time, each climbing to its ceiling before the next starts: two
    stacks of four workers each at once take the whole of two cores themselves (measured:
    hop p50s of 50-100 ms, a broker at 70 % of a core), which no outside load explains. Run
    it on a quiet machine; the load average is recorded beside every run."""
    for c in climbers:
        say(f"live {c.policy}: {static.WORKERS} static workers, ladder {c.ladder} req/s")
        try:
            await c.start()
            while not c.done:
                await c.step(say)
        except (StackError, TimeoutError, OSError) as exc:
            c.fail(exc, say)
        finally:
            await c.stack.stop()
    return [c.result() for c in climbers]


async def _all_workers_heard(stack: PipelineStack) -> None:
    """Every worker's heartbeat seen, so the first run does not start on fewer workers."""
    assert stack.observer is not None
    deadline = time.monotonic() + WORKERS_TIMEOUT_S
    while len(stack.observer.heartbeats) < stack.workers:
        if time.monotonic() > deadline:
            heard = len(stack.observer.heartbeats)
            raise TimeoutError(f"{heard}/{stack.workers} workers heard in {WORKERS_TIMEOUT_S} s")
        await asyncio.sleep(0.1)


async def run_live(
    bootstrap: str | None,
    log_dir: Path,
    simulated: dict[str, float],
    sim_seconds: float,
    say: Say = print,
) -> list[LiveClimb]:
    """batch1 and fixed climbed on `bootstrap`, or on a private broker when None."""
    policies = ("batch1", "fixed")
    if bootstrap is not None:
        climbers = [Climber(p, simulated[p], bootstrap, log_dir, sim_seconds) for p in policies]
        return await climb_in_turn(climbers, say)
    async with private_broker(say) as own:
        climbers = [Climber(p, simulated[p], own, log_dir, sim_seconds) for p in policies]
        return await climb_in_turn(climbers, say)


def _cores(
    pids: dict[str, int], before: dict[str, float | None], wall_s: float
) -> dict[str, float]:
    """Each process's CPU over the run in cores (its workers summed as `workers`)."""
    out: dict[str, float] = {}
    for key, pid in pids.items():
        start, end = before[key], cpu_seconds(pid)
        if start is None or end is None:
            continue
        name = "workers" if key.startswith("worker") else key
        out[name] = out.get(name, 0.0) + (end - start) / max(wall_s, 1e-9)
    return {k: round(v, 2) for k, v in out.items()}


def _one_line(run: LiveRun) -> str:
    hops = ", ".join(f"{k} {v:g}" for k, v in run.hops_ms_p50.items())
    return (
        f"  {run.policy:>6} {run.rate:6g}/s {'pass' if run.passed else 'FAIL'}  "
        f"answered {run.answered}/{run.sent}  TTFT p50 {run.ttft_ms_p50:g} p99 "
        f"{run.ttft_ms_p99:g} ms (simulated p99 {run.predicted_ttft_ms_p99:g})  batch mean "
        f"{run.batch_size_mean:g} of {run.batches}  hops p50 ms: {hops}  load {run.load_avg_1m:g}"
        f"  cores: {', '.join(f'{k} {v:g}' for k, v in run.cores.items())}"
    )
