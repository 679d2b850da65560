"""`tokenbus bench run|compare`: open-loop load over WebSocket, and the policy comparison."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    from bench.report import BenchReport
    from bench.suite import SweepOptions
    from tokenbus.commands import Subcommands

# Load only ever goes to this machine, and never without bounds.
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_RATE = 2000.0
MAX_DURATION_S = 600.0
MAX_CONNECTIONS = 256
MAX_IN_FLIGHT = 10_000
# Where each stack listens and which topics it uses are the bench's to choose.
RESERVED_SETTINGS = frozenset(
    {
        "TOKENBUS_TOPIC_PREFIX",
        "TOKENBUS_EDGE_PORT",
        "TOKENBUS_EDGE_HOST",
        "TOKENBUS_BENCH_DIRECT_PORT",
        "TOKENBUS_BOOTSTRAP_SERVERS",
    }
)


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "bench", help="load-test a local deployment; compare scheduling policies side by side"
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    run = actions.add_parser(
        "run",
        help="open-loop load against a running deployment's /v1/chat (127.0.0.1 only)",
        description="Poisson arrivals at each rate, sent over a pool of WebSocket connections.",
    )
    run.add_argument("--url", default="ws://127.0.0.1:8000/v1/chat", help="edge WebSocket URL")
    run.add_argument(
        "--kafka-prefix",
        default=None,
        help="topic prefix of the deployment: read its batches topic for batch sizes and "
        "batch wait (broker from KAFKA_BOOTSTRAP_SERVERS); else sizes come from chat.done",
    )
    run.add_argument(
        "--max-batch",
        type=int,
        nargs=2,
        default=(16, 32),
        metavar=("INTERACTIVE", "BACKGROUND"),
        help="the scheduler's max batch sizes, for batch fill (default 16 32)",
    )
    _sweep_arguments(run, rates="10", duration=5.0)
    run.add_argument("--json", type=Path, default=Path("bench/out/run.json"))
    run.add_argument("--plots", type=Path, default=None, help="directory for PNG plots")
    run.set_defaults(handler=_run)

    compare = actions.add_parser(
        "compare",
        help="start a stack per policy (batch1, fixed, adaptive, direct) and sweep each",
        description="Each policy gets a fresh stack on the broker in KAFKA_BOOTSTRAP_SERVERS "
        "(or a local one from deploy.kafka.launcher) and faces the same arrivals.",
    )
    compare.add_argument(
        "--policies",
        default="batch1,fixed,adaptive,direct",
        help="comma-separated, from: batch1, fixed, adaptive, direct",
    )
    compare.add_argument("--profile", default="llama3-8b-h100", help="sim engine profile")
    compare.add_argument("--slo-ms", type=float, default=500.0, help="interactive p99 TTFT SLO")
    compare.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TOKENBUS_NAME=VALUE",
        help="a setting for every stack started (repeatable), e.g. TOKENBUS_WORKER_FLUSH_MS=1",
    )
    _sweep_arguments(compare, rates="10,20,35,50,75,100,200", duration=6.0)
    compare.add_argument("--json", type=Path, default=Path("bench/out/compare.json"))
    compare.add_argument("--plots", type=Path, default=Path("bench/out"))
    compare.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="Markdown file whose generated benchmark section to rewrite",
    )
    compare.add_argument("--log-dir", type=Path, default=Path("bench/out/logs"))
    compare.set_defaults(handler=_compare)

    static = actions.add_parser(
        "static",
        help="the static-batch benchmark: batch1, fixed, buckets and adaptive on static sim "
        "workers, simulated in simulated time with the real scheduler policy (make bench-static)",
        description="Highest rate at the interactive SLO against batch size 1, the padded "
        "share of prefill tokens with and without buckets, the adaptive wait at low load.",
    )
    static.add_argument("--seconds", type=float, default=60.0, help="simulated, per run")
    static.add_argument("--slo-ms", type=float, default=500.0, help="interactive p99 TTFT SLO")
    static.add_argument("--json", type=Path, default=Path("bench/out/static.json"))
    static.add_argument("--plot", type=Path, default=None, help="PNG of TTFT p99 against load")
    static.add_argument("--docs", type=Path, default=None, help="rewrite its block in this file")
    static.add_argument(
        "--live",
        action="store_true",
        help="also batch1 and fixed on real stacks, one static worker each (~1-2 min)",
    )
    static.set_defaults(handler=_static)

    capacity = actions.add_parser(
        "capacity",
        help="the capacity benchmark: fixed and direct on the fast constant profile, a rate "
        "climb, CPU per request per process from /proc, overhead at 50 req/s (make bench)",
        description="Each stack climbs a rate ladder until interactive p99 TTFT reaches the "
        "SLO, then bisects; each run samples every process's CPU over itself. Then both run "
        "at one rate on the llama3-8b-h100 profile for the pipeline overhead.",
    )
    capacity.add_argument(
        "--quick", action="store_true", help="a smoke test: two low rates, 3 s each (~1 min)"
    )
    capacity.add_argument("--policies", default="fixed,direct", help="from: fixed, direct, ...")
    capacity.add_argument(
        "--ladder", default=None, help="rates to climb, comma-separated (default 25..1600)"
    )
    capacity.add_argument("--duration", type=float, default=None, help="seconds per rate (6)")
    capacity.add_argument("--slo-ms", type=float, default=500.0, help="interactive p99 TTFT SLO")
    capacity.add_argument(
        "--overhead-warmup",
        type=float,
        default=None,
        metavar="S",
        help="seconds of the overhead rate run first, not counted, in windows as long as the "
        "counted run, each reported (30; 0 with --quick)",
    )
    capacity.add_argument(
        "--shared-broker",
        action="store_true",
        help="use KAFKA_BOOTSTRAP_SERVERS rather than a private broker (its CPU is then shared)",
    )
    capacity.add_argument(
        "--source",
        type=Path,
        default=None,
        help="run the services of this checkout (e.g. a worktree of an older commit)",
    )
    capacity.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TOKENBUS_NAME=VALUE",
        help="a setting for every stack started (repeatable)",
    )
    capacity.add_argument("--json", type=Path, default=Path("bench/out/capacity.json"))
    capacity.add_argument("--plots", type=Path, default=Path("bench/out"))
    capacity.add_argument("--docs", type=Path, default=None, help="Markdown file to update")
    capacity.add_argument("--log-dir", type=Path, default=Path("bench/out/logs"))
    capacity.set_defaults(handler=_capacity)

    cached = actions.add_parser(
        "cache",
        help="the response cache: TTFT and total of a cached answer vs the same request "
        "uncached, on one sim stack (make bench-cache, ~1 min)",
        description="Distinct deterministic requests, each asked once (the worker runs it and"
        " stores the answer) and once more (ingest replays it from the cache topic), one at"
        " a time; client-measured TTFT and total. Broker: KAFKA_BOOTSTRAP_SERVERS.",
    )
    cached.add_argument("--prompts", type=int, default=20, help="distinct requests (20)")
    cached.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each (64)")
    cached.add_argument("--profile", default="llama3-8b-h100", help="sim engine profile")
    cached.add_argument("--json", type=Path, default=Path("bench/out/cache.json"))
    cached.add_argument("--plot", type=Path, default=None, help="PNG of the CDFs")
    cached.add_argument("--docs", type=Path, default=None, help="Markdown file to update")
    cached.add_argument("--log-dir", type=Path, default=Path("bench/out/logs"))
    cached.set_defaults(handler=_cache)
    cold = actions.add_parser(
        "cold-start",
        help="warm pools: TTFT of a request held for a model whose worker starts after it,"
        " against a warm worker's, on one sim stack (make bench-cold-start, ~1 min)",
        description="Requests to a model with a live worker, one at a time; then, per cold"
        " model, a request sent before its worker process starts, held until the worker is"
        " ready. Client-measured TTFT; each cold worker's own load time. Broker:"
        " KAFKA_BOOTSTRAP_SERVERS, else a private one.",
    )
    cold.add_argument("--requests", type=int, default=20, help="warm requests (20)")
    cold.add_argument("--cold", type=int, default=3, help="cold models, one start each (3)")
    cold.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each (16)")
    cold.add_argument(
        "--engine", choices=("sim", "vllm"), default="sim",
        help="sim (default), or vllm: SmolLM2 on vLLM's CPU build (installed the first time)",
    )  # fmt: skip
    cold.add_argument("--profile", default="llama3-8b-h100", help="sim engine profile")
    cold.add_argument("--json", type=Path, default=Path("bench/out/cold_start.json"))
    cold.add_argument("--docs", type=Path, default=None, help="Markdown file to update")
    cold.add_argument("--log-dir", type=Path, default=Path("bench/out/logs"))
    cold.set_defaults(handler=_cold_start)
    batch = actions.add_parser(
        "batch",
        help="chat beside an OpenAI batch: interactive TTFT with and without a saturating"
        " batch, and the batch's throughput against the capacity chat leaves idle"
        " (make bench-batch, ~4 min)",
    )
    batch.add_argument(
        "--engine", choices=("sim", "vllm"), default="sim", help="vllm: SmolLM2 on vLLM's CPU build"
    )
    batch.add_argument("--model", default=None, help="default: sim-8b, or smollm2 on vLLM")
    batch.add_argument("--max-num-seqs", type=int, default=16, help="vllm: sequences at once")
    # A simulated GPU slow enough that it, not the 2 cores running everything, is full.
    batch.add_argument("--profile", default="llama3-70b-fp8-h200", help="sim profile")
    batch.add_argument("--prompt-tokens", type=int, default=60, help="each request's prompt")
    batch.add_argument("--max-tokens", type=int, default=64, help="each request's answer")
    batch.add_argument("--window", type=int, default=128, help="batch lines in flight")
    batch.add_argument(
        "--reserve", type=float, default=0.25, help="the scheduler's interactive reserve"
    )
    batch.add_argument("--load", type=float, default=0.5, help="interactive share of capacity")
    batch.add_argument("--duration", type=float, default=40.0, help="interactive phase, s")
    batch.add_argument("--saturate-lines", type=int, default=600, help="the capacity batch")
    batch.add_argument("--seed", type=int, default=7)
    batch.add_argument("--json", type=Path, default=Path("bench/out/batch.json"))
    batch.add_argument("--plot", type=Path, default=None, help="PNG of TTFT and lines/s")
    batch.add_argument("--docs", type=Path, default=None, help="Markdown file to update")
    batch.add_argument("--log-dir", type=Path, default=Path("bench/out/logs"))
    batch.set_defaults(handler=_batch)

    cascade = actions.add_parser(
        "cascade",
        help="cascades: the share a small model answers, the GPU-seconds saved and the quality"
        " kept, on one sim stack with a small and a large model (make bench-cascade, ~1 min)",
        description="The same prompts to the large model, the small one and the route `auto`"
        " = [small, large] with the refusal verifier; the small worker declines and"
        " mis-answers set shares. Broker: KAFKA_BOOTSTRAP_SERVERS, else a private one.",
    )
    cascade.add_argument("--requests", type=int, default=120, help="prompts per arm (120)")
    cascade.add_argument("--concurrency", type=int, default=16, help="requests at once (16)")
    cascade.add_argument("--max-tokens", type=int, default=48, help="max_tokens of each (48)")
    cascade.add_argument(
        "--refuse-share", type=float, default=0.2, help="small: share of prompts declined (0.2)"
    )
    cascade.add_argument(
        "--wrong-share", type=float, default=0.05, help="small: share answered wrongly (0.05)"
    )
    cascade.add_argument("--json", type=Path, default=Path("bench/out/cascade.json"))
    cascade.add_argument("--plot", type=Path, default=None, help="PNG of GPU-s and quality")
    cascade.add_argument("--docs", type=Path, default=None, help="Markdown file to update")
    cascade.add_argument("--log-dir", type=Path, default=Path("bench/out/logs"))
    cascade.set_defaults(handler=_cascade)
    real = actions.add_parser(
        "real",
        help="the real engine (SmolLM2 on vLLM's CPU build) through tokenbus, side by side"
        " with the same engine called directly, and the smollm2-cpu sim checked against it"
        " (make bench-real, ~6 min; the first time also installs vLLM and the model)",
        description="Closed loops of 1, 4 and 16 clients, the same requests straight to"
        " AsyncLLM and through a stack with one vLLM worker, then through the same stack on"
        " the fitted sim profile. Broker: KAFKA_BOOTSTRAP_SERVERS, else a private one.",
    )
    real.add_argument("--json", type=Path, default=Path("bench/out/real.json"))
    real.add_argument("--plot", type=Path, default=None, help="PNG of TTFT and tokens/s")
    real.add_argument("--docs", type=Path, default=None, help="Markdown file to update")
    real.add_argument("--log-dir", type=Path, default=Path("bench/out/logs"))
    real.set_defaults(handler=_real)
    serve = actions.add_parser(
        "vllm-serve",
        help="tokenbus side by side with vLLM's own OpenAI server, both driven by `vllm bench"
        " serve` at two request rates, the same model and engine settings behind both"
        " (make bench-vllm-serve, ~10 min on 2 cores)",
        description="SmolLM2 on vLLM's CPU build behind `python -m"
        " vllm.entrypoints.openai.api_server` and behind a tokenbus stack with one vLLM worker;"
        " random dataset, 128 tokens in, 64 out, --ignore-eos; rates from a short climb."
        " Broker: KAFKA_BOOTSTRAP_SERVERS, else a private one.",
    )
    serve.add_argument("--json", type=Path, default=Path("bench/out/vllm_serve.json"))
    serve.add_argument("--plot", type=Path, default=None, help="PNG of TTFT, TPOT, tokens/s")
    serve.add_argument("--docs", type=Path, default=None, help="Markdown file to update")
    serve.add_argument("--log-dir", type=Path, default=Path("bench/out/logs"))
    serve.set_defaults(handler=_vllm_serve)
    affinity = actions.add_parser(
        "affinity",
        help="prefix-affinity vs least-loaded routing: a multi-turn chat mix over 4 sim"
        " workers at ~70%% load; hit rate and TTFT p50/p99 side by side (make bench-affinity)",
        description="The scheduler's policy and router in front of 4 sim engines"
        " (llama3-8b-h100, with their prefix caches), in one process; ~3 min on 2 cores.",
    )
    affinity.add_argument("--quick", action="store_true", help="a smoke run (~1 min)")
    affinity.add_argument("--duration", type=float, default=None, help="seconds per routing")
    affinity.add_argument("--json", type=Path, default=Path("bench/out/affinity.json"))
    affinity.add_argument("--plots", type=Path, default=None, help="directory for the PNG")
    affinity.add_argument("--docs", type=Path, default=None, help="Markdown file to update")
    affinity.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one bench.affinity.AffinityOptions field (a Python literal)",
    )
    affinity.set_defaults(handler=_affinity)


def _sweep_arguments(parser: argparse.ArgumentParser, rates: str, duration: float) -> None:
    parser.add_argument(
        "--rates",
        default=rates,
        help=f"offered requests/s, comma-separated, swept in order (default {rates})",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=duration,
        help=f"seconds of arrivals per rate (default {duration:g})",
    )
    parser.add_argument("--connections", type=int, default=8, help="WebSocket connections")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=256,
        help="concurrency cap: arrivals beyond it are counted as shed",
    )
    parser.add_argument(
        "--drain",
        type=float,
        default=10.0,
        help="seconds to wait for answers after the last arrival",
    )
    parser.add_argument(
        "--background-share",
        type=float,
        default=None,
        help="share of background arrivals (default: the mix file's)",
    )
    parser.add_argument("--mix", type=Path, default=None, help="workload mix JSON")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--api",
        default="ws",
        help="client paths to sweep, comma-separated, each reported on its own: ws (the"
        " WebSocket protocol), openai (/v1/chat/completions over SSE) (default ws)",
    )


class UsageError(Exception):
    pass


def _sweep_options(args: argparse.Namespace) -> SweepOptions:
    from bench.suite import APIS, SweepOptions

    try:
        rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        raise UsageError(f"--rates: not a list of numbers: {args.rates!r}") from None
    if not rates or any(not 0 < r <= MAX_RATE for r in rates):
        raise UsageError(f"--rates: each rate must be within (0, {MAX_RATE:g}]")
    if not 0 < args.duration <= MAX_DURATION_S:
        raise UsageError(f"--duration must be within (0, {MAX_DURATION_S:g}] seconds")
    if not 0 <= args.drain <= MAX_DURATION_S:
        raise UsageError(f"--drain must be within [0, {MAX_DURATION_S:g}] seconds")
    if not 1 <= args.connections <= MAX_CONNECTIONS:
        raise UsageError(f"--connections must be within [1, {MAX_CONNECTIONS}]")
    if not 1 <= args.max_in_flight <= MAX_IN_FLIGHT:
        raise UsageError(f"--max-in-flight must be within [1, {MAX_IN_FLIGHT}]")
    apis = tuple(a.strip() for a in args.api.split(",") if a.strip())
    if not apis or any(a not in APIS for a in apis):
        raise UsageError(f"--api: expected a list from {', '.join(APIS)}: {args.api!r}")
    return SweepOptions(
        apis=apis,
        rates=rates,
        duration_s=args.duration,
        connections=args.connections,
        concurrency_cap=args.max_in_flight,
        drain_s=args.drain,
        seed=args.seed,
        background_share=args.background_share,
        mix_path=args.mix,
    )


def _run(args: argparse.Namespace) -> int:
    from bench.suite import against_running
    from shared.settings import TokenbusSettings

    try:
        host = urlparse(args.url).hostname
        if host not in LOCAL_HOSTS:
            raise UsageError(f"--url: load goes to this machine only ({', '.join(LOCAL_HOSTS)})")
        options = _sweep_options(args)
    except (UsageError, ValueError) as exc:
        print(f"tokenbus bench: error: {exc}", file=sys.stderr)
        return 2
    kafka = TokenbusSettings(topic_prefix=args.kafka_prefix) if args.kafka_prefix else None
    max_batch = {"interactive": args.max_batch[0], "background": args.max_batch[1]}
    report = asyncio.run(
        against_running(args.url, options, kafka=kafka, max_batch=max_batch, command=_command())
    )
    _emit(report, args.json, args.plots, None, slo_ms=500.0)
    return 0


def _compare(args: argparse.Namespace) -> int:
    from bench.policies import POLICIES
    from bench.suite import CompareOptions, compare

    try:
        policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        unknown = [p for p in policies if p not in POLICIES]
        if unknown or not policies:
            raise UsageError(f"--policies: unknown {unknown}; known: {', '.join(POLICIES)}")
        extra_env = dict(_setting(item) for item in args.set)
        options = CompareOptions(
            sweep=_sweep_options(args),
            policies=policies,
            profile=args.profile,
            slo_ms=args.slo_ms,
            log_dir=args.log_dir,
            command=_command(),
            extra_env=extra_env,
        )
    except (UsageError, ValueError) as exc:
        print(f"tokenbus bench: error: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(compare(options))
    _emit(report, args.json, args.plots, args.docs, slo_ms=args.slo_ms)
    failed = [p.name for p in report.policies if p.failed]
    if failed:
        print(
            f"tokenbus bench: error: stacks failed to start: {', '.join(failed)}", file=sys.stderr
        )
        return 1
    return 0


def _static(args: argparse.Namespace) -> int:
    from bench.static_command import main

    argv = ["--seconds", str(args.seconds), "--slo-ms", str(args.slo_ms), "--json", str(args.json)]
    if args.plot is not None:
        argv += ["--plot", str(args.plot)]
    if args.docs is not None:
        argv += ["--docs", str(args.docs)]
    if args.live:
        argv.append("--live")
    return main(argv)


def _affinity(args: argparse.Namespace) -> int:
    from bench.affinity import run

    return run(args)


def _capacity(args: argparse.Namespace) -> int:
    from bench import capacity_docs
    from bench.capacity import QUICK, CapacityOptions, capacity
    from bench.policies import POLICIES

    try:
        policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        unknown = [p for p in policies if p not in POLICIES]
        if unknown or not policies:
            raise UsageError(f"--policies: unknown {unknown}; known: {', '.join(POLICIES)}")
        given: dict[str, Any] = dict(QUICK) if args.quick else {}
        if args.ladder:
            ladder = tuple(float(r) for r in args.ladder.split(",") if r.strip())
            if not ladder or any(not 0 < r <= MAX_RATE for r in ladder):
                raise UsageError(f"--ladder: each rate must be within (0, {MAX_RATE:g}]")
            given["ladder"] = ladder
        if args.duration is not None:
            if not 0 < args.duration <= MAX_DURATION_S:
                raise UsageError(f"--duration must be within (0, {MAX_DURATION_S:g}] seconds")
            given["duration_s"] = args.duration
        if args.overhead_warmup is not None:
            if not 0 <= args.overhead_warmup <= MAX_DURATION_S:
                raise UsageError(f"--overhead-warmup must be within [0, {MAX_DURATION_S:g}] s")
            given["overhead_warmup_s"] = args.overhead_warmup
        if args.shared_broker:
            given["own_broker"] = False
        if args.source is not None:
            given["source"] = args.source.resolve()
        options = CapacityOptions(
            policies=policies,
            slo_ms=args.slo_ms,
            log_dir=args.log_dir,
            command=_command(),
            extra_env=dict(_setting(item) for item in args.set),
            **given,
        )
    except (UsageError, ValueError) as exc:
        print(f"tokenbus bench: error: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(capacity(options))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(report.model_dump_json(indent=1))
    print(capacity_docs.text(report))
    print(f"wrote {args.json}")
    print(f"wrote {capacity_docs.plot(report, args.plots)}")
    if args.docs is not None:
        capacity_docs.write(report, args.docs, args.plots)
        print(f"wrote {args.docs}")
    failed = [p.name for p in report.policies if p.failed] + [
        o.policy for o in report.overhead if o.failed
    ]
    if failed:
        print(f"tokenbus bench: error: stacks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _batch(args: argparse.Namespace) -> int:
    from bench import batch

    if args.model is None:
        args.model = "smollm2" if args.engine == "vllm" else batch.SIM_MODEL
    return batch.run(args, _command())


def _cascade(args: argparse.Namespace) -> int:
    from bench import cascade

    return cascade.run(args, _command())


def _cold_start(args: argparse.Namespace) -> int:
    from bench import cold_start

    return cold_start.run(args, _command())


def _cache(args: argparse.Namespace) -> int:
    from bench import cache

    return cache.run(args, _command())


def _real(args: argparse.Namespace) -> int:
    from bench import real_engine

    return real_engine.run(args, _command())


def _vllm_serve(args: argparse.Namespace) -> int:
    from bench import vllm_serve

    return vllm_serve.run(args, _command())


def _emit(
    report: BenchReport, json_path: Path, plots: Path | None, docs: Path | None, slo_ms: float
) -> None:
    from bench import table

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(report.model_dump_json(indent=1))
    print(table.text(report))
    if report.findings is not None:
        for t in report.findings.targets:
            state = {True: "holds", False: "DOES NOT HOLD", None: "not measured"}[t.holds]
            print(f"target: {t.name}: {t.measured} (wanted {t.target}): {state}")
    print(f"wrote {json_path}")
    if plots is not None:
        from bench.plots import draw_all

        for path in draw_all(report, plots, slo_ms):
            print(f"wrote {path}")
    if docs is not None and plots is not None:
        from bench.docs import write

        write(report, docs, plots)
        print(f"wrote {docs}")


def _setting(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    # Only tokenbus settings: the bench owns where stacks listen and which broker they use.
    if not sep or not name.startswith("TOKENBUS_") or name in RESERVED_SETTINGS:
        raise UsageError(f"--set {item!r}: expected TOKENBUS_NAME=VALUE (not a bench-owned one)")
    return name, value


def _command() -> str:
    return "tokenbus " + shlex.join(sys.argv[1:])
