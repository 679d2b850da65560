"""Tracing overhead: end-to-end latency and service CPU with tracing on vs off.

Two identical stacks on one broker: `on` writes every span as JSON lines (what `tokenbus up`
does), `off` has no tracing at all (OTEL_SDK_DISABLED). They are driven alternately (a
lone request, then a burst of concurrent ones, the first stack switching every round), so
both see the same machine noise. Client-measured end-to-end time per request; CPU seconds of
the services' processes (from /proc) per request. Prints one table, writes JSON and a plot.

    KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:19092 python -m bench.tracing_overhead \\
        --json bench/out/tracing_overhead.json --plot bench/out/tracing_overhead.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websockets

from bench.loadgen import warm_up
from bench.stacks import ROOT, PipelineStack
from bench.stats import percentile

MODES = ("off", "on")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class ModeResult:
    lone_ms: list[float] = field(default_factory=list)
    burst_ms: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    requests: int = 0

    def row(self) -> dict[str, Any]:
        lone, burst = sorted(self.lone_ms), sorted(self.burst_ms)
        return {
            "requests": self.requests,
            "lone_p50_ms": round(percentile(lone, 50), 3),
            "lone_p90_ms": round(percentile(lone, 90), 3),
            "burst_p50_ms": round(percentile(burst, 50), 3),
            "burst_p90_ms": round(percentile(burst, 90), 3),
            "cpu_ms_per_request": round(1000 * self.cpu_s / max(1, self.requests), 3),
        }


class Client:
    """One WebSocket to a stack; requests in flight matched to their chat.done by client_id."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.waiting: dict[str, asyncio.Future[float]] = {}
        self._ids = itertools.count()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        by_request: dict[str, str] = {}
        async for message in self.ws:
            frame = json.loads(message)
            if frame["type"] == "chat.accepted":
                by_request[frame["request_id"]] = frame["client_id"]
            elif frame["type"] in ("chat.done", "error"):
                client_id = by_request.pop(frame.get("request_id", ""), frame.get("client_id"))
                future = self.waiting.pop(client_id, None)
                if future is not None:
                    if frame["type"] == "error":
                        future.set_exception(RuntimeError(f"request failed: {frame}"))
                    else:
                        future.set_result(time.perf_counter())

    async def request(self, max_tokens: int) -> float:
        """One request's client-measured end-to-end time, in ms."""
        client_id = f"c{next(self._ids)}"
        done: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.waiting[client_id] = done
        began = time.perf_counter()
        await self.ws.send(
            json.dumps(
                {
                    "type": "chat.request",
                    "client_id": client_id,
                    "prompt": f"measure the cost of tracing {client_id}",
                    "max_tokens": max_tokens,
                }
            )
        )
        return (await asyncio.wait_for(done, 60)) * 1000 - began * 1000

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self.ws.close()


def cpu_seconds(stack: PipelineStack) -> float:
    """User + system CPU of the stack's service processes so far."""
    total = 0
    for proc in stack.processes.values():
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


def count_lines(directory: Path) -> int:
    total = 0
    for path in directory.glob("*.jsonl"):
        with path.open() as f:
            total += sum(1 for _ in f)
    return total


async def measure(
    bootstrap: str, rounds: int, burst: int, max_tokens: int, token_rate: float, log_dir: Path
) -> tuple[dict[str, ModeResult], float]:
    """Results per mode, and the spans written per request by the `on` stack."""
    trace_dir = Path(tempfile.mkdtemp(prefix="tokenbus-traces-"))
    common = {"TOKENBUS_WORKER_SIM_TOKEN_RATE": str(token_rate)}
    envs = {
        "off": {**common, "OTEL_SDK_DISABLED": "true"},
        "on": {**common, "TOKENBUS_TRACE_DIR": str(trace_dir)},
    }
    stacks = {m: PipelineStack(f"trace{m}", envs[m], log_dir, bootstrap) for m in MODES}
    results = {m: ModeResult() for m in MODES}
    clients: dict[str, Client] = {}
    try:
        for stack in stacks.values():
            # Neither stack may export to a collector the environment happens to name.
            stack.env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
            await stack.start()
            await warm_up(stack.ws_url)
        for m, stack in stacks.items():
            clients[m] = Client(await websockets.connect(stack.ws_url))
        cpu_before = {m: cpu_seconds(s) for m, s in stacks.items()}
        for r in range(rounds):
            order = MODES if r % 2 == 0 else tuple(reversed(MODES))
            for m in order:
                results[m].lone_ms.append(await clients[m].request(max_tokens))
                many = await asyncio.gather(*(clients[m].request(max_tokens) for _ in range(burst)))
                results[m].burst_ms.extend(many)
                results[m].requests += 1 + burst
        for m, stack in stacks.items():
            results[m].cpu_s = cpu_seconds(stack) - cpu_before[m]
        await asyncio.sleep(1.0)  # the exporters' last flush (every 500 ms)
        spans = await asyncio.to_thread(count_lines, trace_dir)
        warm_ups = 3
        spans_per_request = spans / (results["on"].requests + warm_ups)
        print(f"spans written by the `on` stack: {spans}, {spans_per_request:.1f} per request")
    finally:
        for client in clients.values():
            await client.close()
        for stack in stacks.values():
            await stack.stop()
    return results, spans_per_request


def span_cost(spans: int = 20000) -> dict[str, float]:
    """CPU microseconds per stage-like span: no SDK vs the SDK writing JSON lines.

    Process CPU time, so the exporter's background thread is counted too; run in a child
    process so the global tracer provider of this one stays untouched.
    """
    code = f"""
import json, sys, tempfile, time
from pathlib import Path
from shared.telemetry import JsonLinesSpanExporter, TelemetrySettings, record_span, setup_tracing
def run(n):
    began = time.process_time()
    for i in range(n):
        record_span("stage decode", start=1.0, end=2.0, context=None,
                    attributes={{"tokenbus.stage": "decode", "tokenbus.request.id": str(i)}})
    return time.process_time() - began
off = run({spans})
provider = setup_tracing("bench", TelemetrySettings(trace_dir=Path(tempfile.mkdtemp())))
began = time.process_time()
run({spans})
provider.shutdown()  # flushes: the export's CPU is counted
on = time.process_time() - began
print(json.dumps({{"off_us": 1e6 * off / {spans}, "on_us": 1e6 * on / {spans}}}))
"""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def overhead(off: float, on: float) -> str:
    return f"{100 * (on - off) / off:+.1f} %" if off else "-"


def table(results: dict[str, ModeResult]) -> str:
    rows = {m: results[m].row() for m in MODES}
    keys = ("lone_p50_ms", "lone_p90_ms", "burst_p50_ms", "burst_p90_ms", "cpu_ms_per_request")
    lines = [
        f"| {'':<20} | {'off':>9} | {'on':>9} | {'on vs off':>9} |",
        f"|{'-' * 22}|{'-' * 11}|{'-' * 11}|{'-' * 11}|",
    ]
    for key in keys:
        off, on = rows["off"][key], rows["on"][key]
        lines.append(f"| {key:<20} | {off:>9.2f} | {on:>9.2f} | {overhead(off, on):>9} |")
    return "\n".join(lines)


def plot(results: dict[str, ModeResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, attr, title in (
        (axes[0], "lone_ms", "one request at a time"),
        (axes[1], "burst_ms", "bursts"),
    ):
        for m in MODES:
            values = sorted(getattr(results[m], attr))
            ax.plot(
                values, [(i + 1) / len(values) for i in range(len(values))], label=f"tracing {m}"
            )
        ax.set_title(title)
        ax.set_xlabel("end-to-end ms (client)")
        ax.set_ylabel("fraction of requests")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--burst", type=int, default=8, help="concurrent requests per burst")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--token-rate", type=float, default=200.0, help="sim tokens/s/seq")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--log-dir", type=Path, default=Path("bench/out/logs"))
    args = parser.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    results, spans_per_request = await measure(
        bootstrap, args.rounds, args.burst, args.max_tokens, args.token_rate, args.log_dir
    )
    print(table(results))
    cost = span_cost()
    tracing_ms = spans_per_request * (cost["on_us"] - cost["off_us"]) / 1000
    lone_p50 = results["off"].row()["lone_p50_ms"]
    print(
        f"one span: {cost['off_us']:.1f} us CPU without SDK, {cost['on_us']:.1f} us with JSON"
        f" lines; x {spans_per_request:.1f} spans = {tracing_ms:.2f} ms CPU per request"
        f" ({100 * tracing_ms / lone_p50:.1f} % of the untraced lone p50)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "config": vars(args) | {"json": str(args.json), "plot": str(args.plot),
                                            "log_dir": str(args.log_dir)},
                    "summary": {m: results[m].row() for m in MODES},
                    "span_cpu_us": cost,
                    "spans_per_request": spans_per_request,
                    "samples": {m: {"lone_ms": results[m].lone_ms, "burst_ms": results[m].burst_ms}
                                for m in MODES},
                },
                indent=2,
            )
        )  # fmt: skip
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(results, args.plot)


if __name__ == "__main__":
    asyncio.run(main())
