"""The static benchmark's live check: batch size 1 against the bus rule on a real stack.

`tokenbus bench static --live`. One stack per policy on the broker in
KAFKA_BOOTSTRAP_SERVERS, else a private one (edge, ingest, scheduler and
one worker in TOKENBUS_WORKER_BATCH_MODE=static on the `llama3-8b-h100` sim profile), the
same open-loop Poisson arrivals for both (bench/loadgen.py), at one rate where the
simulation (bench/static.py, one worker) says batch size 1 cannot keep up and the bus rule
can. What it checks is the simulation's prediction, through Kafka and real processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from bench import static
from bench.loadgen import LoadConfig, run_load, warm_up
from bench.stacks import PipelineStack, private_broker
from bench.workload import LengthDistribution, Mix, RequestClass, plan
from services.worker.engines.sim_profiles import sim_profile
from shared.messages import Tier

RATE = 4.0  # req/s: one static worker; the simulation puts batch size 1 far past its SLO
DURATION_S = 20.0
DRAIN_S = 15.0


@dataclass
class LiveRun:
    policy: str
    rate: float
    sent: int
    answered: int
    ttft_ms_p50: float
    ttft_ms_p99: float
    predicted_ttft_ms_p99: float  # the simulation's, same policy, rate and one worker


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


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))] if ordered else math.nan


async def run_policy(policy: str, bootstrap: str, log_dir: Path) -> LiveRun:
    planned = plan(mix(), RATE, DURATION_S, seed=static.SEED)
    stack = PipelineStack(f"static{policy}", env(policy), log_dir, bootstrap)
    try:
        await stack.start()
        await warm_up(stack.ws_url)
        result = await run_load(LoadConfig(stack.ws_url, connections=4, drain_s=DRAIN_S), planned)
    finally:
        await stack.stop()
    ttft = [
        (t.delta_at[0] - t.sent_at) * 1000
        for t in result.traces
        if t.delta_at and t.sent_at is not None
    ]
    answered = sum(1 for t in result.traces if t.done_at is not None)
    # Requests never answered within the drain count as past any SLO.
    ttft += [math.inf] * (len(result.traces) - len(ttft))
    workers = static.WORKERS
    static.WORKERS = 1
    try:
        profile = sim_profile(static.PROFILE, max_num_seqs=static.SLOTS, token_rate=50.0)
        predicted = static.simulate(static.POLICIES[policy], profile, RATE, DURATION_S)
    finally:
        static.WORKERS = workers
    return LiveRun(
        policy=policy,
        rate=RATE,
        sent=len(result.traces),
        answered=answered,
        ttft_ms_p50=round(_quantile(ttft, 0.5), 1),
        ttft_ms_p99=round(_quantile(ttft, 0.99), 1),
        predicted_ttft_ms_p99=predicted.ttft_ms_p99,
    )


async def run_live(bootstrap: str | None, log_dir: Path) -> list[LiveRun]:
    """Both policies on `bootstrap`, or on a private broker when None."""
    if bootstrap is not None:
        return [await run_policy(p, bootstrap, log_dir) for p in ("batch1", "fixed")]
    async with private_broker() as own:
        return [await run_policy(p, own, log_dir) for p in ("batch1", "fixed")]
