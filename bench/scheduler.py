"""The scheduler's policy, measured: its own speed, and what it does at low, medium and full load.

Three parts, all in one process and all deterministic (seeded):

1. throughput: requests per second the pure policy (`Policy.add` + `Policy.plan`) sustains
   on one core, for the fixed and adaptive rules, pack and bucket batching;
2. fit: the adaptive rule's cost line `per_request * n + per_batch`, least-squares fitted
   (as BentoML does) to the `sim` engine profile's time to admit a batch of n prompts;
3. load: a discrete-event simulation in simulated time: Poisson arrivals, the real
   `Policy`, and one worker whose step times come from the `sim` engine's profile
   (continuous batching: batches join at step boundaries, their prompts prefilled in that
   step). Per tier: batch size, fill ratio and the wait the scheduler added, at low, medium
   and saturating load. The Kafka pipeline itself is measured by `make bench` (bench/suite.py).

    python -m bench.scheduler --json bench/out/scheduler.json --plot docs/img/scheduler_load.png
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.stats import percentile
from services.scheduler.departure import (
    AdaptiveRule,
    CostModel,
    DepartureRule,
    FixedRule,
    fit_cost_model,
)
from services.scheduler.limits import Batching, PolicyConfig
from services.scheduler.policy import Policy, WorkerSlots
from services.scheduler.settings import SchedulerSettings
from services.worker.engines.sim_profiles import SimProfile, sim_profile
from shared.messages import Tier

SEED = 7
INTERACTIVE_SHARE = 0.7
PROMPT_TOKENS = (50, 500)
OUTPUT_TOKENS = (32, 256)


def default_config(batching: Batching = "pack") -> PolicyConfig:
    base = SchedulerSettings(scheduler_id="bench").policy_config()
    return replace(base, batching=batching)


def adaptive_rule() -> AdaptiveRule:
    s = SchedulerSettings(scheduler_id="bench", scheduler_policy="adaptive")
    rule = s.departure_rule()
    assert isinstance(rule, AdaptiveRule)
    return rule


# -- 1. throughput ------------------------------------------------------------------------


@dataclass
class Throughput:
    rule: str
    batching: str
    requests: int
    seconds: float
    batches: int

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds


def throughput(rule: DepartureRule, batching: Batching, requests: int) -> Throughput:
    """Arrivals 10 us apart in simulated time, a plan every simulated millisecond."""
    rng = random.Random(SEED)
    policy: Policy[int] = Policy(default_config(batching), rule)
    workers = [WorkerSlots(f"w{i}", 64, 64) for i in range(4)]
    tiers = [
        Tier.interactive if rng.random() < INTERACTIVE_SHARE else Tier.background
        for _ in range(requests)
    ]
    prompts = [rng.randint(*PROMPT_TOKENS) for _ in range(requests)]
    outputs = [rng.randint(*OUTPUT_TOKENS) for _ in range(requests)]
    batches = 0
    started = time.perf_counter()
    for i in range(requests):
        now = i * 1e-5
        policy.add(
            i, tier=tiers[i], cost=prompts[i] + outputs[i], prompt_tokens=prompts[i], now=now
        )
        if i % 100 == 99:
            batches += len(policy.plan(now, workers).dispatches)
    now = requests * 1e-5 + 1.0
    batches += len(policy.plan(now, workers).dispatches)
    seconds = time.perf_counter() - started
    assert policy.waiting() == 0
    return Throughput(rule.name, batching, requests, seconds, batches)


# -- 2. fit ------------------------------------------------------------------------------


def fit_profile(profile: SimProfile, prompt_tokens: int, running: int) -> CostModel:
    """The step in which n prompts join `running` sequences: its time, fitted over n."""
    kv = running * 300
    samples = [
        (n, profile.step_seconds(running + n, kv, prefill_tokens=n * prompt_tokens))
        for n in (1, 2, 4, 8, 16, 32)
    ]
    return fit_cost_model(samples, prior=CostModel(0.001, 0.01))


# -- 3. load -------------------------------------------------------------------------------


@dataclass
class Sequence:
    tier: Tier
    prompt: int
    output: int
    arrived: float
    done_tokens: int = 0


@dataclass
class TierStats:
    batch_sizes: list[int] = field(default_factory=list)
    fills: list[float] = field(default_factory=list)
    waits_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)

    def row(self) -> dict[str, float]:
        if not self.waits_ms:
            return {}
        waits = sorted(self.waits_ms)
        ttft = sorted(self.ttft_ms)
        return {
            "requests": len(waits),
            # A tier's requests can all ride in the other tier's batches (short runs do that).
            "batch_size": round(statistics.fmean(self.batch_sizes), 2) if self.batch_sizes else 0.0,
            "fill": round(statistics.fmean(self.fills), 3) if self.fills else 0.0,
            "wait_ms_mean": round(statistics.mean(waits), 2),
            "wait_ms_p99": round(percentile(waits, 99), 2),
            "ttft_ms_p50": round(percentile(ttft, 50), 2),
            "ttft_ms_p99": round(percentile(ttft, 99), 2),
        }


@dataclass
class LoadRun:
    rule: str
    load: str
    rate: float  # requests/s offered
    tiers: dict[str, dict[str, float]]


def simulate_load(
    rule: DepartureRule, profile: SimProfile, rate: float, seconds: float
) -> dict[Tier, TierStats]:
    rng = random.Random(SEED)
    config = default_config()
    policy: Policy[Sequence] = Policy(config, rule)
    stats = {t: TierStats() for t in Tier}
    arrivals: list[tuple[float, Sequence]] = []
    t = 0.0
    while t < seconds:
        t += rng.expovariate(rate)
        tier = Tier.interactive if rng.random() < INTERACTIVE_SHARE else Tier.background
        arrivals.append(
            (t, Sequence(tier, rng.randint(*PROMPT_TOKENS), rng.randint(*OUTPUT_TOKENS), t))
        )
    running: list[Sequence] = []
    joining: list[Sequence] = []  # admitted, prefilled in the next step
    first_token: set[int] = set()
    step_end: float | None = None
    wake: float | None = None
    now = 0.0
    i = 0
    while i < len(arrivals) or running or joining or policy.waiting():
        candidates = [x for x in (step_end, wake) if x is not None]
        if i < len(arrivals):
            candidates.append(arrivals[i][0])
        if not candidates:
            break
        now = max(now, min(candidates))
        while i < len(arrivals) and arrivals[i][0] <= now:
            seq = arrivals[i][1]
            policy.add(
                seq, tier=seq.tier, cost=seq.prompt + seq.output, prompt_tokens=seq.prompt, now=now
            )
            i += 1
        if step_end is not None and now >= step_end:
            for seq in running:
                seq.done_tokens += 1
                if id(seq) not in first_token:
                    first_token.add(id(seq))
                    stats[seq.tier].ttft_ms.append((now - seq.arrived) * 1000)
            running = [s for s in running if s.done_tokens < s.output]
            step_end = None
        busy = len(running) + len(joining)
        free = profile.max_num_seqs - busy
        plan = policy.plan(now, [WorkerSlots("w0", free, profile.max_num_seqs)])
        wake = plan.wake_at if plan.wake_at is not None and plan.wake_at > now else None
        for d in plan.dispatches:
            limit = config.tiers[d.tier].max_batch_size
            stats[d.tier].batch_sizes.append(len(d.passengers))
            stats[d.tier].fills.append(len(d.passengers) / limit)
            for p in d.passengers:
                stats[p.tier].waits_ms.append((now - p.item.arrived) * 1000)
                joining.append(p.item)
        if step_end is None and (running or joining):
            prefill = sum(s.prompt for s in joining)
            running.extend(joining)
            joining = []
            kv = sum(s.prompt + s.done_tokens for s in running)
            step_end = now + profile.step_seconds(len(running), kv, prefill_tokens=prefill)
    return stats


def capacity(profile: SimProfile, requests: int = 2000) -> float:
    """Requests/s one worker finishes when it always has work: a burst, timed to the end."""
    rng = random.Random(SEED)
    running: list[Sequence] = []
    waiting = [
        Sequence(Tier.interactive, rng.randint(*PROMPT_TOKENS), rng.randint(*OUTPUT_TOKENS), 0.0)
        for _ in range(requests)
    ]
    now = 0.0
    while running or waiting:
        joining = waiting[: profile.max_num_seqs - len(running)]
        waiting = waiting[len(joining) :]
        running.extend(joining)
        kv = sum(s.prompt + s.done_tokens for s in running)
        now += profile.step_seconds(len(running), kv, sum(s.prompt for s in joining))
        for seq in running:
            seq.done_tokens += 1
        running = [s for s in running if s.done_tokens < s.output]
    return requests / now


# -- 4. dispatch cost on a real broker (optional) ---------------------------------------------


async def dispatch_latency(bootstrap: str, rounds: int = 60) -> dict[str, dict[str, float]]:
    """One dispatch = a batch record plus the tier offset that covers it, two ways:

    - `transaction`: batch and offset commit in one Kafka transaction (exactly once, alone);
    - `produce+commit`: idempotent produce, then a commit with metadata (what the scheduler
      does; the restart scan of the batches topic closes the gap between the two);
    - `produce`: the produce alone: all a worker waits for in the scheduler's design, where
      commits are batched off the dispatch path. With a transaction, the worker
      (read_committed) sees the batch only once the whole transaction is committed.
    Each back to back and 20 ms apart (the broker finishes a transaction asynchronously).
    """
    import asyncio
    import uuid

    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.structs import OffsetAndMetadata

    from shared.kafka import make_admin, make_producer, new_topic
    from shared.settings import TokenbusSettings

    prefix = "bsched" + uuid.uuid4().hex[:6]
    tier, batches, group = f"{prefix}.tier", f"{prefix}.batches", f"{prefix}.group"
    admin = make_admin(TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap))
    await admin.start()
    await admin.create_topics([new_topic(tier, 1, 1), new_topic(batches, 1, 1)])
    tp = TopicPartition(tier, 0)
    payload = b"x" * 2000
    out: dict[str, dict[str, float]] = {}
    settings = TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap)
    txn = make_producer(settings, "bench-scheduler-txn", transactional_id=f"{prefix}.tx")
    plain = make_producer(settings, "bench-scheduler")
    consumer = AIOKafkaConsumer(
        tier, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    try:
        for client in (txn, plain, consumer):
            await client.start()
        for gap in (0.0, 0.02):
            for name in ("transaction", "produce+commit", "produce"):
                samples = []
                for i in range(rounds):
                    await asyncio.sleep(gap)
                    started = time.perf_counter()
                    offset = OffsetAndMetadata(i + 1, '{"v":1}')
                    if name == "transaction":
                        async with txn.transaction():
                            await (await txn.send(batches, payload, partition=0))
                            await txn.send_offsets_to_transaction({tp: offset}, group)
                    elif name == "produce+commit":
                        await plain.send_and_wait(batches, payload, partition=0)
                        await consumer.commit({tp: offset})
                    else:
                        await plain.send_and_wait(batches, payload, partition=0)
                    samples.append((time.perf_counter() - started) * 1000)
                samples.sort()
                out[f"{name}, {gap * 1000:.0f} ms apart"] = {
                    "p50_ms": round(percentile(samples, 50), 2),
                    "p90_ms": round(percentile(samples, 90), 2),
                }
    finally:
        for client in (txn, plain, consumer):
            await client.stop()
        await admin.delete_topics([tier, batches])
        await admin.close()
    return out


# -- report ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000, help="throughput part")
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument("--seconds", type=float, default=60.0, help="simulated, per load")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--bootstrap", help="also time one dispatch on this Kafka broker")
    args = parser.parse_args(argv)

    out: dict[str, Any] = {}
    print(f"## Policy throughput, one core, {args.requests} requests")
    print("| rule | batching | requests/s | batches |")
    print("|---|---|---:|---:|")
    runs = []
    for rule, batching in (
        (FixedRule(), "pack"),
        (FixedRule(), "buckets"),
        (adaptive_rule(), "pack"),
    ):
        run = throughput(rule, batching, args.requests)  # type: ignore[arg-type]
        runs.append(run)
        print(f"| {run.rule} | {run.batching} | {run.per_second:,.0f} | {run.batches} |")
    out["throughput"] = [asdict(r) | {"per_second": r.per_second} for r in runs]

    profile = sim_profile(args.profile, max_num_seqs=64, token_rate=50.0)
    print(f"\n## Adaptive cost line fitted to the `{args.profile}` sim profile (32 running)")
    print("| prompt tokens | per_request_ms | per_batch_ms |")
    print("|---:|---:|---:|")
    fits = []
    for prompt in (100, 300, 1000):
        fitted = fit_profile(profile, prompt, running=32)
        fits.append(
            {
                "prompt_tokens": prompt,
                "per_request_ms": fitted.per_request_s * 1000,
                "per_batch_ms": fitted.per_batch_s * 1000,
            }
        )
        print(f"| {prompt} | {fitted.per_request_s * 1000:.3f} | {fitted.per_batch_s * 1000:.3f} |")
    out["fit"] = fits

    full = capacity(profile)
    loads = {"low": 0.1 * full, "medium": 0.5 * full, "saturating": 1.0 * full}
    print(
        f"\n## Load, `{args.profile}` sim profile, one worker of 64 slots "
        f"(capacity ~{full:.0f} req/s), {args.seconds:.0f} s simulated"
    )
    print(
        "| rule | load | req/s | tier | batch size | fill | added wait mean ms | p99 ms "
        "| TTFT p50 ms | p99 ms |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    load_runs: list[LoadRun] = []
    for rule in (FixedRule(), adaptive_rule()):
        for name, rate in loads.items():
            stats = simulate_load(rule, profile, rate, args.seconds)
            load_run = LoadRun(
                rule.name, name, round(rate, 1), {t.value: s.row() for t, s in stats.items()}
            )
            load_runs.append(load_run)
            for tier, row in load_run.tiers.items():
                if not row:
                    continue
                print(
                    f"| {load_run.rule} | {name} | {rate:.1f} | {tier} | {row['batch_size']} "
                    f"| {row['fill']} | {row['wait_ms_mean']} | {row['wait_ms_p99']} "
                    f"| {row['ttft_ms_p50']} | {row['ttft_ms_p99']} |"
                )
    out["load"] = [asdict(r) for r in load_runs]
    if args.bootstrap:
        import asyncio

        latency = asyncio.run(dispatch_latency(args.bootstrap))
        print(f"\n## One dispatch on the broker at {args.bootstrap}")
        print("| how | p50 ms | p90 ms |")
        print("|---|---:|---:|")
        for how, row in latency.items():
            print(f"| {how} | {row['p50_ms']} | {row['p90_ms']} |")
        out["dispatch_latency"] = latency
    out["profile"] = args.profile
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    if args.plot:
        plot(load_runs, args.plot)
    return 0


def plot(runs: list[LoadRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for rule in sorted({r.rule for r in runs}):
        for tier, style in (("interactive", "-o"), ("background", "--s")):
            mine = [r for r in runs if r.rule == rule and r.tiers.get(tier)]
            loads = [r.load for r in mine]
            axes[0].plot(
                loads, [r.tiers[tier]["wait_ms_mean"] for r in mine], style, label=f"{rule} {tier}"
            )
            axes[1].plot(
                loads, [r.tiers[tier]["batch_size"] for r in mine], style, label=f"{rule} {tier}"
            )
    axes[0].set_ylabel("wait added by the scheduler, mean ms")
    axes[1].set_ylabel("batch size, mean")
    for ax in axes:
        ax.set_xlabel("load")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
