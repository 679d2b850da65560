"""Fair share between tenants: one tenant's flood against another's short requests.

Two stacks on one broker, fair share on (the default) and off (first come, first served),
each with one sim worker small enough to be the bottleneck, driven in turn. In each:

1. `b alone`: tenant B sends short requests at a steady pace, nobody else is there;
2. `a alone`: tenant A sends a flood of long requests at once (its throughput, B idle);
3. `a + b`: A's flood again; once all of it has passed ingest (it is on the tier topics)
   and fills the worker, B sends the same short requests as in 1. Waiting for ingest keeps
   the measurement on the scheduler: ingest handles requests in arrival order, so a flood
   still delays everyone by the time ingest takes to read it (`A to tier s`).

Time to first token is client-measured (request sent to first `chat.delta`); A's
throughput is its output tokens over the time from its first request to its last answer.
Both tenants ask for the interactive tier, so fair share (not priority) is what separates
them. Prints one table, writes JSON and a plot.

    KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:29092 python -m bench.fairness \\
        --json bench/out/fairness.json --plot docs/img/fairness.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import websockets
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.loadgen import warm_up
from bench.stacks import PipelineStack
from bench.stats import percentile
from shared.topics import Topics

MODES = ("fair", "fifo")
TENANTS = ("a", "b")
# A tenant's chat URL, with its API key in it.
UrlOf = Callable[[str], str]
PHASES = ("b alone", "a alone", "a + b")


@dataclass(frozen=True)
class Scenario:
    a_requests: int = 200
    a_max_tokens: tuple[int, int] = (60, 140)  # drawn per request: A's requests differ
    b_requests: int = 20
    b_max_tokens: int = 8
    b_gap_s: float = 0.15  # B sends one request every gap (an interactive user, not a burst)
    slots: int = 8  # the worker's max_num_seqs
    token_rate: float = 200.0  # sim tokens/s per sequence
    seed: int = 7

    def stack_env(self) -> dict[str, str]:
        return {
            "TOKENBUS_WORKER_MAX_NUM_SEQS": str(self.slots),
            "TOKENBUS_WORKER_SIM_TOKEN_RATE": str(self.token_rate),
        }


@dataclass
class Answer:
    sent: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    error: dict[str, Any] | None = None


class TenantClient:
    """One tenant's WebSocket; times each request's first delta and its end."""

    def __init__(self, ws: websockets.ClientConnection, name: str) -> None:
        self.ws = ws
        self.name = name
        self.answers: dict[str, Answer] = {}
        self._by_request: dict[str, str] = {}
        self._ids = itertools.count()
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, url_of: UrlOf, tenant: str) -> TenantClient:
        # The edge knows the tenant by its API key, which the URL carries.
        ws = await websockets.connect(url_of(tenant), max_queue=None)
        return cls(ws, tenant)

    async def _read(self) -> None:
        async for message in self.ws:
            frame = json.loads(message)
            now = time.perf_counter()
            kind = frame["type"]
            if kind == "chat.accepted":
                self._by_request[frame["request_id"]] = frame["client_id"]
                continue
            client_id = self._by_request.get(frame.get("request_id", ""), frame.get("client_id"))
            answer = self.answers.get(client_id or "")
            if answer is None:
                continue
            if kind == "chat.delta" and answer.first is None:
                answer.first = now
            elif kind == "chat.done":
                answer.done = now
                answer.tokens = int(frame["usage"]["completion_tokens"])
            elif kind == "error":
                answer.done, answer.error = now, frame
            self._changed.set()

    async def send(self, max_tokens: int) -> None:
        client_id = f"{self.name}{next(self._ids)}"
        self.answers[client_id] = Answer(sent=time.perf_counter())
        frame = {
            "type": "chat.request",
            "client_id": client_id,
            "prompt": f"tenant {self.name} asks {client_id}",
            "max_tokens": max_tokens,
            "priority": "interactive",
        }
        await self.ws.send(json.dumps(frame))

    def count(self, *, started: bool = False, ended: bool = False) -> int:
        return sum(
            1
            for a in self.answers.values()
            if (not started or a.first is not None) and (not ended or a.done is not None)
        )

    async def until(self, predicate: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: {what} not within {timeout_s:.0f} s")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 1.0)):
                    await self._changed.wait()

    def errors(self) -> list[dict[str, Any]]:
        return [a.error for a in self.answers.values() if a.error is not None]

    def ttft_ms(self) -> list[float]:
        return [1000 * (a.first - a.sent) for a in self.answers.values() if a.first is not None]

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@dataclass
class PhaseResult:
    b_ttft_ms: list[float] = field(default_factory=list)
    a_tokens: int = 0
    a_seconds: float = 0.0
    a_queued_max: int = 0  # A's requests accepted but not started, at most (seen by B's sends)
    a_to_tier_s: float = 0.0  # from A's first send until all of A's flood was on the tier topics

    @property
    def a_tokens_per_s(self) -> float:
        return self.a_tokens / self.a_seconds if self.a_seconds else 0.0

    def row(self) -> dict[str, float]:
        ttft = sorted(self.b_ttft_ms)
        out: dict[str, float] = {}
        if ttft:
            out |= {
                "b_ttft_p50_ms": round(percentile(ttft, 50), 1),
                "b_ttft_p99_ms": round(percentile(ttft, 99), 1),
                "b_ttft_max_ms": round(ttft[-1], 1),
            }
        if self.a_tokens:
            out |= {
                "a_tokens_per_s": round(self.a_tokens_per_s, 1),
                "a_seconds": round(self.a_seconds, 2),
                "a_queued_max": self.a_queued_max,
            }
        if self.a_to_tier_s:
            out["a_to_tier_s"] = round(self.a_to_tier_s, 2)
        return out


async def tenant_b(
    url_of: UrlOf, s: Scenario, a: TenantClient | None = None
) -> tuple[list[float], int]:
    """B's paced requests; their TTFTs, and how many of A's waited unstarted meanwhile."""
    b = await TenantClient.connect(url_of, "b")
    queued = 0
    try:
        for _ in range(s.b_requests):
            if a is not None:
                queued = max(queued, a.count() - a.count(started=True))
            await b.send(s.b_max_tokens)
            await asyncio.sleep(s.b_gap_s)
        await b.until(lambda: b.count(ended=True) == s.b_requests, 120, "B's answers")
        if b.errors():
            raise RuntimeError(f"B got errors: {b.errors()[:3]}")
        return b.ttft_ms(), queued
    finally:
        await b.close()


async def flood_a(url_of: UrlOf, s: Scenario) -> TenantClient:
    a = await TenantClient.connect(url_of, "a")
    rng = random.Random(s.seed)
    for _ in range(s.a_requests):
        await a.send(rng.randint(*s.a_max_tokens))
    return a


async def finish_a(a: TenantClient, s: Scenario, result: PhaseResult) -> None:
    budget = 60 + 4 * s.a_requests * s.a_max_tokens[1] / (s.slots * s.token_rate)
    await a.until(lambda: a.count(ended=True) == s.a_requests, budget, "A's answers")
    if a.errors():
        raise RuntimeError(f"A got errors: {a.errors()[:3]}")
    result.a_tokens = sum(x.tokens for x in a.answers.values())
    began = min(x.sent for x in a.answers.values())
    result.a_seconds = max(x.done or began for x in a.answers.values()) - began


class TierTopics:
    """How many records the stack's tier topics hold: what ingest has handed to the scheduler."""

    def __init__(self, bootstrap: str, prefix: str) -> None:
        self.consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
        topics = Topics(prefix)
        self.parts = [
            TopicPartition(t, p) for t in topics.tiers for p in range(topics.partitions()[t])
        ]

    async def __aenter__(self) -> TierTopics:
        await self.consumer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()

    async def records(self) -> int:
        return sum((await self.consumer.end_offsets(self.parts)).values())

    async def until(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while await self.records() < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"tier topics below {count} records after {timeout_s:.0f} s")
            await asyncio.sleep(0.05)


async def run_phase(url_of: UrlOf, phase: str, s: Scenario, tiers: TierTopics) -> PhaseResult:
    result = PhaseResult()
    if phase == "b alone":
        result.b_ttft_ms, _ = await tenant_b(url_of, s)
        return result
    before = await tiers.records()
    a = await flood_a(url_of, s)
    try:
        if phase == "a + b":
            # B starts once A's flood has passed ingest and fills the worker: the rest of
            # it waits in the scheduler, where fair share decides.
            await tiers.until(before + s.a_requests, 120)
            result.a_to_tier_s = time.perf_counter() - min(x.sent for x in a.answers.values())
            await a.until(lambda: a.count(started=True) >= s.slots, 60, "A filling the worker")
            result.b_ttft_ms, result.a_queued_max = await tenant_b(url_of, s, a)
        await finish_a(a, s, result)
    finally:
        await a.close()
    return result


async def measure(bootstrap: str, s: Scenario, log_dir: Path) -> dict[str, dict[str, PhaseResult]]:
    """Both stacks up at once, driven in turn (the first mode switching every phase), so
    both see the same machine noise; only one is loaded at a time."""
    stacks: dict[str, PipelineStack] = {}
    for mode in MODES:
        env = s.stack_env() | {"TOKENBUS_SCHEDULER_FAIR_SHARE": str(mode == "fair").lower()}
        stacks[mode] = PipelineStack(f"fair{mode}", env, log_dir, bootstrap, tenants=TENANTS)
    results: dict[str, dict[str, PhaseResult]] = {mode: {} for mode in MODES}
    try:
        async with contextlib.AsyncExitStack() as tiers_of:
            tiers: dict[str, TierTopics] = {}
            for mode, stack in stacks.items():
                await stack.start()
                await warm_up(stack.ws_url)
                tiers[mode] = await tiers_of.enter_async_context(
                    TierTopics(bootstrap, stack.prefix)
                )
            for n, phase in enumerate(PHASES):
                for mode in MODES[n % 2 :] + MODES[: n % 2]:
                    url_of = stacks[mode].ws_url_as
                    results[mode][phase] = await run_phase(url_of, phase, s, tiers[mode])
                    print(f"  {mode:5} {phase:8} {results[mode][phase].row()}", flush=True)
    finally:
        for stack in stacks.values():
            await stack.stop()
    return results


def table(results: dict[str, dict[str, PhaseResult]]) -> str:
    head = [
        "mode",
        "phase",
        "B TTFT p50 ms",
        "B p99",
        "B max",
        "A tok/s",
        "A s",
        "A queued",
        "A to tier s",
    ]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for mode, phases in results.items():
        for phase, r in phases.items():
            row = r.row()

            def cell(key: str, row: dict[str, float] = row) -> str:
                return f"{row[key]:g}" if key in row else ""

            lines.append(
                " | ".join(
                    [
                        mode,
                        phase,
                        cell("b_ttft_p50_ms"),
                        cell("b_ttft_p99_ms"),
                        cell("b_ttft_max_ms"),
                        cell("a_tokens_per_s"),
                        cell("a_seconds"),
                        cell("a_queued_max"),
                        cell("a_to_tier_s"),
                    ]
                )
            )
    return "\n".join(f"| {line} |" for line in lines)


def plot(results: dict[str, dict[str, PhaseResult]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, phases in results.items():
        for phase in ("b alone", "a + b"):
            ttft = sorted(phases[phase].b_ttft_ms)
            if ttft:
                ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
                style = "-" if phase == "a + b" else ":"
                label = f"{mode}: B " + ("with A's flood" if phase == "a + b" else "alone")
                left.step(ttft, ys, style, where="post", label=label)
    left.set_xscale("log")
    left.set_xlabel("B time to first token, ms (log)")
    left.set_ylabel("share of B's requests")
    left.legend()
    names = [f"{m}\n{p}" for m in results for p in ("a alone", "a + b")]
    rates = [results[m][p].a_tokens_per_s for m in results for p in ("a alone", "a + b")]
    right.bar(names, rates)
    right.set_ylabel("A output tokens/s")
    fig.suptitle("Tenant A floods, tenant B sends short requests (one sim worker)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a-requests", type=int, default=Scenario.a_requests)
    parser.add_argument("--b-requests", type=int, default=Scenario.b_requests)
    parser.add_argument("--slots", type=int, default=Scenario.slots)
    parser.add_argument("--token-rate", type=float, default=Scenario.token_rate)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--log-dir", type=Path, default=Path("bench/out/logs"))
    args = parser.parse_args()
    s = Scenario(
        a_requests=args.a_requests,
        b_requests=args.b_requests,
        slots=args.slots,
        token_rate=args.token_rate,
    )
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    results = await measure(bootstrap, s, args.log_dir)
    print(table(results))
    for mode, phases in results.items():
        alone, flooded = phases["b alone"].row(), phases["a + b"].row()
        print(
            f"{mode}: B p99 with A's flood / B alone = "
            f"{flooded['b_ttft_p99_ms'] / alone['b_ttft_p99_ms']:.2f}x"
        )
    if args.json:
        summary = {m: {p: r.row() for p, r in ph.items()} for m, ph in results.items()}
        samples = {m: {p: r.b_ttft_ms for p, r in ph.items()} for m, ph in results.items()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"scenario": asdict(s), "summary": summary, "b_ttft_ms": samples}
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(results, args.plot)


if __name__ == "__main__":
    asyncio.run(main())
