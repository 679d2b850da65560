"""The static-batch benchmark (`make bench-static`): where the bus rule pays.

A static engine (Triton's static batcher, a padded `model.generate`, a TensorRT engine
without in-flight batching) runs one batch at a time: the batch's prompts are padded to
the longest, and every row decodes until the longest output ends. Whoever forms the batch
decides the GPU's efficiency, and with TOKENBUS_WORKER_BATCH_MODE=static that is the
scheduler: each batch record runs as one engine call.

A discrete-event simulation in simulated time, deterministic (seeded), of Poisson
interactive arrivals, the real scheduler `Policy` (services/scheduler/policy.py) with the
settings of each policy, and static workers whose batch timeline is the `sim` engine's own
static cost model (`SimProfile.static_batch_seconds`, docs/sim-profiles.md), the one the
worker runs in static mode. What the simulation adds around the engine, and where it
comes from:

- a worker advertises its slots free again `FREE_NOTICE_S` after its batch ends (a static
  worker's heartbeat goes out as its batch's last row ends, services/worker/heartbeat.py
  `_min_gap`; then a Kafka hop);
- every TTFT carries pipeline overhead (edge, ingest, scheduler, worker and the Kafka
  hops between them) drawn from a lognormal with the p50 and p99 that
  `make bench-policies` measured (`PIPELINE_P50_S`, `PIPELINE_P99_S`).

Three findings, each checked against issue 14's target:

1. bus rule: the highest rate with interactive p99 TTFT under the SLO, `batch1` (batch
   size 1: each request holds the GPU alone) against the scheduler's batching;
2. buckets: the padded share of prefill tokens, `pack` against `buckets`, at one load;
3. adaptive wait: low-load TTFT and saturation throughput, adaptive against fixed.

    python -m bench.static --json bench/out/static.json --plot docs/img/static_bus_rule.png \
        --docs docs/benchmarks.md
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.stats import percentile
from services.scheduler.departure import AdaptiveRule, CostModel, fit_cost_model
from services.scheduler.policy import Dispatch, Policy, WorkerSlots
from services.scheduler.settings import SchedulerSettings
from services.worker.engines.sim_profiles import SimProfile, sim_profile
from shared.messages import Tier

SEED = 7
PROFILE = "llama3-8b-h100"
WORKERS = 4
SLOTS = 32  # per worker; the scheduler's max batch size is the same (one batch at a time)
# Interactive chat: prompts log-uniform over this range (system prompt + a turn or a
# document), replies short (a static engine suits short outputs; a long one would hold
# its whole batch). Tokens.
PROMPT_TOKENS = (32, 512)
OUTPUT_TOKENS = (16, 64)
# The contrast: long prompts, where padded prefill (compute-bound) dominates a batch.
LONG_PROMPT_TOKENS = (32, 2048)
SLO_MS = 500.0
KAFKA_HOP_S = 0.005  # one produce + fetch on a local broker (assumption, a few ms)
FREE_NOTICE_S = KAFKA_HOP_S  # the beat goes out at once; one hop to the scheduler
# `make bench-policies` (docs/benchmarks.md): pipeline overhead of `fixed` at 50 req/s.
PIPELINE_P50_S = 0.030
PIPELINE_P99_S = 0.127
PIPELINE_SIGMA = math.log(PIPELINE_P99_S / PIPELINE_P50_S) / 2.326  # z of the 99th percentile
WARMUP_S = 5.0

LOW_LOADS = (0.02, 0.05, 0.1)  # shares of fixed's saturation throughput
LOW_LOAD = 0.02  # the one the target is checked at: low enough that no worker is busy

# Issue 14's targets (point 1).
BUS_RULE_RATIO_TARGET = 4.0


@dataclass(frozen=True)
class PolicySpec:
    name: str
    description: str
    settings: dict[str, Any]


POLICIES: dict[str, PolicySpec] = {
    p.name: p
    for p in (
        PolicySpec(
            "batch1",
            "batch size 1: each request runs alone on a static worker",
            {"scheduler_interactive_max_batch_size": 1},
        ),
        PolicySpec(
            "fixed",
            f"the bus rule, fixed 10 ms timeout, batches of up to {SLOTS}, one queue (pack)",
            {"scheduler_interactive_max_batch_size": SLOTS},
        ),
        PolicySpec(
            "buckets",
            "as fixed, batched by prompt-length bucket (256/1024/4096 tokens)",
            {"scheduler_interactive_max_batch_size": SLOTS, "scheduler_batching": "buckets"},
        ),
        PolicySpec(
            "adaptive",
            "the adaptive departure rule, its cost line fitted to the static cost model",
            {"scheduler_interactive_max_batch_size": SLOTS, "scheduler_policy": "adaptive"},
        ),
    )
}


@dataclass
class Request:
    prompt: int
    output: int
    arrived: float
    first_token_at: float = math.nan
    done_at: float = math.nan


@dataclass
class Worker:
    worker_id: str
    advertised: int = 0  # the free slots the scheduler believes it has
    busy_until: float | None = None  # the running batch's end
    queue: list[list[Request]] = field(default_factory=list)  # batches sent, not started
    free_at: float | None = None  # when its heartbeat says it is free again


@dataclass
class RunStats:
    policy: str
    offered_rps: float
    requests: int
    done_rps: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    batch_size_mean: float
    padded_share: float  # of the prefill tokens computed, the share that were padding
    batches: int


def static_cost_line(profile: SimProfile) -> CostModel:
    """The adaptive rule's `per_request_s * n + per_batch_s`, fitted to static batches."""
    mid_prompt = int(math.sqrt(PROMPT_TOKENS[0] * PROMPT_TOKENS[1]))
    longest = OUTPUT_TOKENS[1]
    samples = [
        (n, profile.static_batch_seconds([mid_prompt] * n, [longest] * n).batch_s)
        for n in (1, 2, 4, 8, 16, 32)
    ]
    return fit_cost_model(samples, prior=CostModel(0.001, 0.1))


def make_policy(spec: PolicySpec, profile: SimProfile) -> Policy[Request]:
    s = SchedulerSettings(scheduler_id="bench-static", **spec.settings)
    rule = s.departure_rule()
    if spec.settings.get("scheduler_policy") == "adaptive":
        # The settings' default line is fitted to a continuous engine; refit to static batches.
        rule = AdaptiveRule(static_cost_line(profile))
    return Policy(s.policy_config(), rule)


def arrivals(
    rate: float, seconds: float, seed: int = SEED, prompts: tuple[int, int] = PROMPT_TOKENS
) -> list[Request]:
    rng = random.Random(seed)
    lo, hi = math.log(prompts[0]), math.log(prompts[1])
    out: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        prompt = int(math.exp(rng.uniform(lo, hi)))
        out.append(Request(prompt, rng.randint(*OUTPUT_TOKENS), t))


def simulate(
    spec: PolicySpec,
    profile: SimProfile,
    rate: float,
    seconds: float,
    seed: int = SEED,
    prompts: tuple[int, int] = PROMPT_TOKENS,
) -> RunStats:
    """One run: arrivals for `seconds` (simulated), then until every request is done."""
    policy = make_policy(spec, profile)
    overhead = random.Random(seed + 1)
    workers = [Worker(f"w{i}", SLOTS) for i in range(WORKERS)]
    pending = arrivals(rate, seconds, seed, prompts)
    requests = list(pending)
    pending.reverse()
    sizes: list[int] = []
    padded = real = 0
    now = 0.0
    wake: float | None = None

    def start(worker: Worker, batch: list[Request], at: float) -> None:
        nonlocal padded, real
        timing = profile.static_batch_seconds([r.prompt for r in batch], [r.output for r in batch])
        begin = at + KAFKA_HOP_S  # the batch record reaches the worker
        for r, done in zip(batch, timing.row_done_s, strict=True):
            pipeline = overhead.lognormvariate(math.log(PIPELINE_P50_S), PIPELINE_SIGMA)
            r.first_token_at = begin + timing.first_token_s + pipeline
            r.done_at = begin + done
        worker.busy_until = begin + timing.batch_s
        longest = max(r.prompt for r in batch)
        padded += len(batch) * longest
        real += sum(r.prompt for r in batch)

    while pending or policy.waiting() or any(w.busy_until or w.queue for w in workers):
        times: list[float] = [] if wake is None else [wake]
        if pending:
            times.append(pending[-1].arrived)
        for w in workers:
            times += [t for t in (w.busy_until, w.free_at) if t is not None]
        if not times:
            break
        now = max(now, min(times))
        while pending and pending[-1].arrived <= now:
            r = pending.pop()
            cost = r.prompt + r.output
            policy.add(r, tier=Tier.interactive, cost=cost, prompt_tokens=r.prompt, now=now)
        for w in workers:
            if w.busy_until is not None and w.busy_until <= now:
                w.busy_until = None
                if w.queue:  # batches sent meanwhile run back to back
                    start(w, w.queue.pop(0), now - KAFKA_HOP_S)
                else:
                    w.free_at = now + FREE_NOTICE_S
            if w.free_at is not None and w.free_at <= now:
                w.free_at = None
                w.advertised = SLOTS
        plan = policy.plan(now, [WorkerSlots(w.worker_id, w.advertised, SLOTS) for w in workers])
        wake = plan.wake_at if plan.wake_at is not None and plan.wake_at > now else None
        by_id = {w.worker_id: w for w in workers}
        for d in plan.dispatches:
            _dispatch(by_id[d.worker_id], d, now, start, sizes)
    measured = [r for r in requests if r.arrived >= WARMUP_S]
    ttft = sorted((r.first_token_at - r.arrived) * 1000 for r in measured)
    last = max((r.done_at for r in requests), default=seconds)
    return RunStats(
        policy=spec.name,
        offered_rps=round(rate, 3),
        requests=len(requests),
        done_rps=round(len(requests) / max(last, seconds), 3),
        ttft_ms_p50=round(percentile(ttft, 50), 1) if ttft else math.nan,
        ttft_ms_p99=round(percentile(ttft, 99), 1) if ttft else math.nan,
        batch_size_mean=round(sum(sizes) / len(sizes), 2) if sizes else 0.0,
        padded_share=round(1 - real / padded, 4) if padded else 0.0,
        batches=len(sizes),
    )


def _dispatch(
    worker: Worker, d: Dispatch[Request], now: float, start: Any, sizes: list[int]
) -> None:
    batch = [p.item for p in d.passengers]
    sizes.append(len(batch))
    worker.advertised = 0  # the scheduler: a static worker's batch takes all its slots
    if worker.busy_until is None and not worker.queue:
        start(worker, batch, now)
    else:
        worker.queue.append(batch)


def capacity(spec: PolicySpec, profile: SimProfile, seconds: float) -> float:
    """Saturation throughput: requests/s done with the lane never empty (3x overload)."""
    guess = WORKERS * SLOTS / profile.static_batch_seconds([256] * SLOTS, [64] * SLOTS).batch_s
    rate = 3 * guess if spec.name != "batch1" else 3 * WORKERS / 0.4
    run = simulate(spec, profile, rate, seconds)
    return run.done_rps


def highest_rate(
    spec: PolicySpec,
    profile: SimProfile,
    seconds: float,
    slo_ms: float,
    runs: list[RunStats],
    prompts: tuple[int, int] = PROMPT_TOKENS,
) -> float:
    """The highest rate (of a doubling ladder, then bisection) whose p99 TTFT is under the SLO."""
    lo, hi, rate = 0.0, None, 0.25
    while hi is None and rate < 10_000:
        run = simulate(spec, profile, rate, seconds, prompts=prompts)
        runs.append(run)
        if run.ttft_ms_p99 < slo_ms:
            lo, rate = rate, rate * 2
        else:
            hi = rate
    if hi is None:
        return lo
    for _ in range(5):
        mid = (lo + hi) / 2
        run = simulate(spec, profile, mid, seconds, prompts=prompts)
        runs.append(run)
        if run.ttft_ms_p99 < slo_ms:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Target:
    name: str
    measured: str
    wanted: str
    holds: bool


@dataclass
class StaticReport:
    created_at: str
    elapsed_s: float
    command: str
    profile: str
    setup: dict[str, Any]
    highest_rate: dict[str, float]
    highest_rate_long_prompts: dict[str, float]
    saturation_rps: dict[str, float]
    buckets: list[RunStats]
    low_load: list[RunStats]
    runs: list[RunStats]
    targets: list[Target]
    live: list[dict[str, Any]] = field(default_factory=list)  # bench/static_live.py, --live
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the machine's, at the end


def bus_rule_live(simulated: Target, batch1: float, fixed: float) -> Target:
    """The bus-rule target decided by the live ceilings, the simulated ratio beside them."""
    ratio = fixed / batch1 if batch1 else math.inf
    if ratio >= BUS_RULE_RATIO_TARGET:
        by = f"met, {ratio / BUS_RULE_RATIO_TARGET:.2f}x the target"
    else:
        by = f"missed by {BUS_RULE_RATIO_TARGET / ratio:.2f}x" if ratio else "missed: fixed 0"
    return Target(
        "bus rule: rate at p99 TTFT < SLO, fixed / batch1 (live, real stacks)",
        f"{ratio:.1f}x ({fixed:g} vs {batch1:g} req/s; {by}); simulated " + simulated.measured,
        f">= {BUS_RULE_RATIO_TARGET:g}x",
        ratio >= BUS_RULE_RATIO_TARGET,
    )


def run_all(seconds: float, slo_ms: float, command: str) -> StaticReport:
    started = time.monotonic()
    profile = sim_profile(PROFILE, max_num_seqs=SLOTS, token_rate=50.0)
    runs: list[RunStats] = []
    highest = {
        name: round(highest_rate(POLICIES[name], profile, seconds, slo_ms, runs), 2)
        for name in ("batch1", "fixed", "adaptive")
    }
    saturation = {
        name: round(capacity(POLICIES[name], profile, seconds), 2)
        for name in ("batch1", "fixed", "buckets", "adaptive")
    }
    long_prompts = {
        name: round(
            highest_rate(POLICIES[name], profile, seconds, slo_ms, [], LONG_PROMPT_TOKENS), 2
        )
        for name in ("batch1", "fixed")
    }
    load = 0.7 * saturation["fixed"]
    bucket_runs = [simulate(POLICIES[n], profile, load, seconds) for n in ("fixed", "buckets")]
    low = LOW_LOAD * saturation["fixed"]
    low_runs = [
        simulate(POLICIES[n], profile, share * saturation["fixed"], seconds)
        for share in LOW_LOADS
        for n in ("fixed", "adaptive")
    ]
    ratio = highest["fixed"] / highest["batch1"] if highest["batch1"] else math.inf
    pack, buck = bucket_runs
    at_low = LOW_LOADS.index(LOW_LOAD) * 2
    fixed_low, adaptive_low = low_runs[at_low : at_low + 2]
    sat_gap = abs(saturation["adaptive"] / saturation["fixed"] - 1)
    targets = [
        Target(
            "bus rule: rate at p99 TTFT < SLO, fixed / batch1 (simulated; --live measures it)",
            f"{ratio:.1f}x ({highest['fixed']:g} vs {highest['batch1']:g} req/s)",
            f">= {BUS_RULE_RATIO_TARGET:g}x",
            ratio >= BUS_RULE_RATIO_TARGET,
        ),
        Target(
            f"buckets: padded share of prefill tokens at {load:.0f} req/s (simulated)",
            f"{buck.padded_share:.1%} with buckets vs {pack.padded_share:.1%} without",
            "lower with buckets",
            buck.padded_share < pack.padded_share,
        ),
        Target(
            f"adaptive: low-load ({low:.1f} req/s) TTFT p50, at equal saturation "
            "throughput (simulated)",
            f"{adaptive_low.ttft_ms_p50:g} ms vs fixed {fixed_low.ttft_ms_p50:g} ms; "
            f"saturation {saturation['adaptive']:g} vs {saturation['fixed']:g} req/s",
            "lower TTFT, throughput within 5 %",
            adaptive_low.ttft_ms_p50 < fixed_low.ttft_ms_p50 and sat_gap <= 0.05,
        ),
    ]
    return StaticReport(
        created_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        elapsed_s=round(time.monotonic() - started, 1),
        command=command,
        profile=PROFILE,
        setup={
            "workers": WORKERS,
            "slots": SLOTS,
            "prompt_tokens": PROMPT_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "long_prompt_tokens": LONG_PROMPT_TOKENS,
            "slo_ms": slo_ms,
            "seconds": seconds,
            "free_notice_s": FREE_NOTICE_S,
            "pipeline_p50_s": PIPELINE_P50_S,
            "pipeline_p99_s": PIPELINE_P99_S,
            "kafka_hop_s": KAFKA_HOP_S,
            "adaptive_cost_line": asdict(static_cost_line(profile)),
        },
        highest_rate=highest,
        highest_rate_long_prompts=long_prompts,
        saturation_rps=saturation,
        buckets=bucket_runs,
        low_load=low_runs,
        runs=runs,
        targets=targets,
    )


def print_report(report: StaticReport, say: Any = print) -> None:
    say(f"## Static batching, `{report.profile}` sim profile ({report.elapsed_s:g} s)")
    for t in report.targets:
        say(f"- {t.name}: {t.measured} (wanted {t.wanted}): {'met' if t.holds else 'MISSED'}")
    say("| policy | highest rate at SLO req/s | saturation req/s |")
    for name, rate in report.highest_rate.items():
        say(f"| {name} | {rate:g} | {report.saturation_rps.get(name, math.nan):g} |")
    for live in report.live:
        say(
            f"live {live['policy']}, {live['workers']} static workers: ceiling "
            f"{live['ceiling_rps']:g} req/s (simulated {live['simulated_ceiling_rps']:g}), "
            f"first failing {live['first_failing_rps']}, {len(live['runs'])} runs"
            + (f"; failed: {live['failed']}" if live["failed"] else "")
        )
    say(f"load average at the end: {' '.join(f'{v:g}' for v in report.load_average)}")
