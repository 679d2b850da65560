"""Where each service spends its CPU at a steady rate: py-spy flame graphs and `/proc` shares.

One command starts a pipeline stack (the `fixed` policy on the fast `constant` profile, logs
at WARNING), drives open-loop load at one rate, and meanwhile

1. records each service with `py-spy record --nonblocking` (SVG flame graphs);
2. takes every process's CPU from `/proc` over the whole run, from the first request sent
   to the last answered (edge, ingest, scheduler, worker, the broker, this process as the
   load generator), so CPU per request counts all the work the requests caused even where
   a loaded machine lets a backlog build up.

    python -m bench.profile --label after        # docs/perf/<service>-after.svg + cpu-after.json

py-spy samples from its own process without stopping the target, so the CPU it spends is
not in the services' figures (it does compete for the same cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from bench.capacity import source_commit
from bench.cpu import CpuSampler, CpuWindow, listening_pid, window
from bench.flames import FrameShare, by_package, top_frames
from bench.loadgen import LoadConfig, ProgressLine, run_load, warm_up
from bench.policies import POLICIES, fast_constant_profile
from bench.stacks import ROOT, SERVICES, PipelineStack
from bench.suite import broker_if_needed, machine_now
from bench.workload import Mix, plan

PROFILED = ("edge", "ingest", "scheduler", "worker")
SETTLE_S = 4.0  # load runs this long before anything is measured
SPY_RATE_HZ = 100
TOP_FRAMES = 15
WAIT_LOAD_MAX_S = 600.0


class ServiceProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    svg: str
    samples: int
    top_self: list[FrameShare]
    by_package: list[FrameShare]


class ProfileReport(BaseModel):
    """`docs/perf/cpu-<label>.json`: the CPU window and each service's top frames."""

    model_config = ConfigDict(extra="forbid")

    label: str
    created_at: str
    commit: str
    rate_rps: float
    achieved_rps: float
    output_tokens_per_s: float
    errors: dict[str, int]
    env: dict[str, str]
    broker_measured: str
    machine: dict[str, object]
    load_average_before: list[float]
    load_average_after: list[float]
    cpu: CpuWindow
    profiles: dict[str, ServiceProfile]
    note: str = ""  # how the run went, where a reader of the figures needs to know


def py_spy() -> str:
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise SystemExit("bench.profile: py-spy not found; pip install -e '.[bench]'")
    return found


async def record(pid: int, svg: Path, seconds: float) -> None:
    """`py-spy record` of one process for `seconds`; non-blocking, so the target never stops."""
    process = await asyncio.create_subprocess_exec(
        py_spy(),
        "record",
        "--pid",
        str(pid),
        "--output",
        str(svg),
        "--duration",
        str(round(seconds)),
        "--rate",
        str(SPY_RATE_HZ),
        "--nonblocking",
        "--function",  # one frame per function, not per line
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"py-spy on pid {pid}: exit {process.returncode}: {err.decode()[-500:]}")


async def profile(args: argparse.Namespace) -> ProfileReport:
    say = print
    out: Path = args.out
    engine = fast_constant_profile()
    env = {**engine.env, **POLICIES["fixed"].env}
    await _quiet_enough(args.wait_load, say)
    load_before = [round(v, 2) for v in os.getloadavg()]
    async with broker_if_needed([POLICIES["fixed"]], say, own=not args.shared_broker) as bootstrap:
        assert bootstrap is not None
        source = args.source.resolve() if args.source else ROOT
        stack = PipelineStack("profile", env, args.log_dir, bootstrap, source=source)
        try:
            await stack.start()
            await warm_up(stack.ws_url)
            planned = plan(Mix.load(), args.rate, args.duration, args.seed)
            config = LoadConfig(
                stack.ws_url, connections=8, concurrency_cap=100_000, drain_s=args.drain
            )
            say(f"load: {args.rate:g} req/s for {args.duration:g} s ({len(planned)} requests)")
            port = int(bootstrap.split(",")[0].rsplit(":", 1)[1])
            broker = listening_pid(port)
            pids = {k: v for k, v in stack.pids.items() if k in SERVICES}
            if broker is not None:
                pids["broker"] = broker
            sampler = CpuSampler(pids, stack.worker_metrics_url)
            before = sampler.read()
            load = asyncio.create_task(run_load(config, planned, ProgressLine()))
            await asyncio.sleep(SETTLE_S)
            spy_s = max(1.0, args.duration - SETTLE_S)
            say(f"py-spy on {', '.join(PROFILED)} for {spy_s:g} s")
            svgs = {name: out / f"{name}-{args.label}.svg" for name in PROFILED}
            await asyncio.gather(*(record(stack.pids[n], svgs[n], spy_s) for n in PROFILED))
            result = await load
            after = sampler.read()
            stack.check_alive()
        finally:
            await stack.stop()
    done = [t for t in result.traces if t.completed]
    tokens = sum(t.completion_tokens or 0 for t in done)
    sent = sum(1 for t in result.traces if t.sent_at is not None)
    elapsed = max(1e-9, result.ended_at - result.started_at)
    profiles = {}
    for name, svg in svgs.items():
        samples, top = top_frames(svg, TOP_FRAMES)
        profiles[name] = ServiceProfile(
            svg=svg.name, samples=samples, top_self=top, by_package=by_package(svg)
        )
    return ProfileReport(
        label=args.label,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        commit=source_commit(stack.source),
        rate_rps=args.rate,
        achieved_rps=round(len(done) / elapsed, 2),
        output_tokens_per_s=round(tokens / elapsed, 1),
        errors=dict(Counter(t.error_code for t in result.traces if t.error_code)),
        env=env,
        broker_measured="yes" if broker is not None else "no: its pid was not found",
        machine=machine_now().model_dump(),
        load_average_before=load_before,
        load_average_after=[round(v, 2) for v in os.getloadavg()],
        cpu=window(before, after, len(done), tokens, sent=sent),
        profiles=profiles,
    )


async def _quiet_enough(limit: float | None, say: Callable[[str], None]) -> None:
    """Wait (at most WAIT_LOAD_MAX_S) until the 1-minute load average is below `limit`."""
    if limit is None:
        return
    deadline = time.monotonic() + WAIT_LOAD_MAX_S
    while (load := os.getloadavg()[0]) >= limit and time.monotonic() < deadline:
        say(f"load average {load:.1f} >= {limit:g}: waiting")
        await asyncio.sleep(15)


def summary(report: ProfileReport) -> str:
    cpu = report.cpu
    lines = [
        f"{report.label} @ {report.commit}: {report.rate_rps:g} req/s offered, "
        f"{report.achieved_rps:g} done/s, {report.output_tokens_per_s:.0f} output tokens/s, "
        f"errors {report.errors or 0}; "
        f"load average {report.load_average_before} -> {report.load_average_after}",
        f"CPU window (first send to last answer) {cpu.window_s:g} s: {cpu.sent} sent, "
        f"{cpu.requests} completed",
        f"{'process':<10} {'share':>7} {'ms/req':>8} {'ms/1k tok':>10}",
    ]
    for name, p in sorted(cpu.processes.items(), key=lambda kv: -kv[1].cpu_s):
        lines.append(
            f"{name:<10} {p.share_of_core:7.1%} {p.ms_per_request or 0:8.2f} "
            f"{p.ms_per_1k_tokens or 0:10.2f}"
        )
    if cpu.engine_in_worker:
        lines.append(cpu.engine_in_worker)
    for name, prof in report.profiles.items():
        lines.append(f"{name} ({prof.samples} samples), top self frames:")
        lines += [f"  {f.share:6.1%}  {f.frame}" for f in prof.top_self[:8]]
        packages = ", ".join(f"{f.frame} {f.share:.0%}" for f in prof.by_package)
        lines.append(f"  by package: {packages}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--label", default="after", help="file suffix: <service>-<label>.svg")
    parser.add_argument("--rate", type=float, default=60.0, help="offered requests/s")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument(
        "--drain", type=float, default=60.0, help="seconds to wait for answers after them"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--source",
        type=Path,
        default=None,
        help="run the services of this checkout instead (e.g. a `git worktree` of the commit "
        "before the change), with this checkout's load generator",
    )
    parser.add_argument(
        "--shared-broker",
        action="store_true",
        help="use KAFKA_BOOTSTRAP_SERVERS (else the local broker) instead of a private one on "
        "free ports; the broker's CPU then includes whatever else uses it",
    )
    parser.add_argument(
        "--wait-load",
        type=float,
        default=None,
        metavar="LOAD",
        help="first wait (up to 10 min) until the 1-minute load average is below LOAD",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/perf"))
    parser.add_argument("--log-dir", type=Path, default=Path("bench/out/logs"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not 0 < args.rate <= 2000:
        parser.error("--rate must be within (0, 2000]")
    report = asyncio.run(profile(args))
    path = args.out / f"cpu-{args.label}.json"
    path.write_text(report.model_dump_json(indent=1) + "\n")
    print(summary(report))
    print(f"wrote {path} and {', '.join(p.svg for p in report.profiles.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
