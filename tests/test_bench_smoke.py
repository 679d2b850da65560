"""`tokenbus bench` end to end for a few seconds at a low rate: its JSON has every field.

No timing assertions: the numbers belong to docs/benchmarks.md, not to the test suite.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.capacity import CapacityOptions, CapacityRun, _by, ceiling, next_rate, warmup_windows
from bench.cpu import CpuWindow, Reading, cpu_seconds, listening_pid, window
from bench.findings import slo_result
from bench.flames import top_frames
from bench.report import Distribution, PolicyReport, RunSummary
from bench.summary import HOPS
from bench.workload import Mix, plan, poisson_arrivals
from tests.stack import ROOT, Stack

REPORT_KEYS = {
    "schema_version",
    "created_at",
    "command",
    "target",
    "sim_profile",
    "sim_profile_note",
    "workload",
    "machine",
    "policies",
    "findings",
    "elapsed_s",
}
MACHINE_KEYS = {"platform", "python", "cpu", "cores", "memory_gib", "load_before", "load_after"}
POLICY_KEYS = {"name", "kind", "available", "failed", "note", "env", "max_batch_size", "runs"}
RUN_KEYS = {
    "policy",
    "offered_rps",
    "duration_s",
    "seed",
    "connections",
    "concurrency_cap",
    "sent",
    "completed",
    "shed",
    "incomplete",
    "errors",
    "elapsed_s",
    "achieved_rps",
    "output_tokens_per_s",
    "tiers",
    "batches",
    "generator_lag_ms",
    "load_avg_1m",
    "ttft_samples_ms",
}
TIER_KEYS = {
    "sent",
    "completed",
    "errors",
    "incomplete",
    "output_tokens",
    "ttft_ms",
    "itl_ms",
    "tpot_ms",
    "e2e_ms",
    "engine_ttft_ms",
    "batch_wait_ms",
    "overhead_ms",
    "hops_ms",
}
DISTRIBUTIONS = (
    "ttft_ms",
    "itl_ms",
    "tpot_ms",
    "e2e_ms",
    "engine_ttft_ms",
    "batch_wait_ms",
    "overhead_ms",
)
DIST_KEYS = {"count", "mean", "p50", "p95", "p99", "max"}
BATCH_KEYS = {"source", "counts", "batches", "size", "fill", "histogram", "reasons"}
FINDINGS_KEYS = {
    "slo_ttft_ms",
    "overhead",
    "slo",
    "saturation",
    "low_load_ttft_p50_ms",
    "targets",
}
PLOTS = ("latency_vs_load.png", "ttft_cdf.png", "batch_sizes.png")


def _bench(*args: str, bootstrap: str | None = None, timeout: float = 120) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if bootstrap is not None:
        env["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tokenbus.cli import main; sys.exit(main())",
            "bench",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"tokenbus bench {args[0]} failed:\n{proc.stdout}\n{proc.stderr}"


def _check_run(run: dict[str, Any]) -> None:
    assert set(run) == RUN_KEYS
    assert run["completed"] > 0, "no request completed: the run measured nothing"
    assert set(run["tiers"]) == {"interactive", "background", "all"}
    for tier in run["tiers"].values():
        assert set(tier) == TIER_KEYS
        for name in DISTRIBUTIONS:
            assert set(tier[name]) == DIST_KEYS, name
    everyone = run["tiers"]["all"]
    # Every measure the report is about has samples, even in a short run.
    for name in ("ttft_ms", "e2e_ms", "engine_ttft_ms", "batch_wait_ms", "overhead_ms"):
        assert everyone[name]["count"] > 0, name
    assert set(run["batches"]) == BATCH_KEYS
    assert set(run["batches"]["size"]) == DIST_KEYS
    assert set(run["generator_lag_ms"]) == DIST_KEYS
    assert set(run["ttft_samples_ms"]) == {"interactive", "background"}


def _check_report(report: dict[str, Any]) -> None:
    assert set(report) == REPORT_KEYS
    assert set(report["machine"]) == MACHINE_KEYS
    for policy in report["policies"]:
        assert set(policy) == POLICY_KEYS


@pytest.mark.kafka
def test_bench_run_against_a_running_stack(stack: Stack, bootstrap: str, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    _bench(
        "run",
        "--url",
        stack.ws_url,
        "--rates",
        "4",
        "--duration",
        "2",
        "--seed",
        "3",
        "--kafka-prefix",
        stack.prefix,
        "--json",
        str(out),
        "--plots",
        str(tmp_path),
        bootstrap=bootstrap,
    )
    report = json.loads(out.read_text())
    _check_report(report)
    (policy,) = report["policies"]
    (run,) = policy["runs"]
    _check_run(run)
    # The batches topic was read: sizes come from the scheduler itself.
    assert run["batches"]["source"] == "scheduler"
    assert run["batches"]["batches"] > 0
    # ...and every request's TTFT is cut into its hops between the services.
    assert set(run["tiers"]["all"]["hops_ms"]) == set(HOPS)
    assert run["tiers"]["all"]["hops_ms"]["engine_first_token"]["count"] == run["completed"]
    for name in PLOTS:
        assert (tmp_path / name).stat().st_size > 0, name


@pytest.mark.kafka
def test_bench_compare_starts_its_own_stacks(bootstrap: str, tmp_path: Path) -> None:
    out, doc = tmp_path / "compare.json", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nA section someone else wrote.\n")
    _bench(
        "compare",
        "--policies",
        "fixed,direct",
        "--rates",
        "4",
        "--duration",
        "2",
        "--json",
        str(out),
        "--plots",
        str(tmp_path / "img"),
        "--docs",
        str(doc),
        "--log-dir",
        str(tmp_path / "logs"),
        bootstrap=bootstrap,
    )
    report = json.loads(out.read_text())
    _check_report(report)
    assert [p["name"] for p in report["policies"]] == ["fixed", "direct"]
    for policy in report["policies"]:
        assert policy["available"], policy["note"]
        assert not policy["failed"], policy["note"]
        (run,) = policy["runs"]
        _check_run(run)
    assert set(report["findings"]) == FINDINGS_KEYS
    assert {t["name"] for t in report["findings"]["targets"]} >= {
        "pipeline overhead p50 at 50 req/s (fixed)",
        "adaptive saturation tokens/s vs fixed",
    }
    for name in PLOTS:
        assert (tmp_path / "img" / name).stat().st_size > 0, name
    text = doc.read_text()
    assert "A section someone else wrote." in text
    assert "tokenbus-bench:begin" in text
    assert "img/latency_vs_load.png" in text


# Pure pieces of the bench, with plain values.


def test_poisson_arrivals_have_the_asked_rate_and_stay_in_the_window() -> None:
    times = poisson_arrivals(100.0, 50.0, random.Random(1))
    assert all(0 <= a < b < 50.0 for a, b in itertools.pairwise(times))
    assert 4700 < len(times) < 5300  # 5000 expected; 4 standard deviations either side


def test_plan_is_reproducible_and_follows_the_tier_mix() -> None:
    mix = Mix.load()
    assert plan(mix, 50, 4, seed=9) == plan(mix, 50, 4, seed=9)
    only_background = plan(mix.with_background_share(1.0), 50, 4, seed=9)
    assert {p.tier.value for p in only_background} == {"background"}
    for p in plan(mix, 50, 4, seed=9):
        assert p.body["type"] == "chat.request"
        assert p.body["priority"] == p.tier.value
    with pytest.raises(ValueError, match="within"):
        mix.with_background_share(1.5)


def _run(rate: float, p99: float, completed: int = 10) -> RunSummary:
    tier = {
        "sent": 10,
        "completed": completed,
        "errors": 0,
        "incomplete": 10 - completed,
        "output_tokens": 0,
        **{n: Distribution() for n in DISTRIBUTIONS},
    }
    tier["ttft_ms"] = Distribution(count=10, p50=p99 / 2, p99=p99)
    return RunSummary.model_validate(
        {
            "policy": "p",
            "offered_rps": rate,
            "duration_s": 1,
            "seed": 0,
            "connections": 1,
            "concurrency_cap": 1,
            "sent": 10,
            "completed": completed,
            "shed": 0,
            "incomplete": 10 - completed,
            "errors": {},
            "elapsed_s": 1,
            "achieved_rps": 1,
            "output_tokens_per_s": 1,
            "tiers": {"interactive": tier, "background": tier, "all": tier},
            "batches": {
                "source": "none",
                "counts": "requests",
                "batches": 0,
                "size": Distribution(),
                "fill": Distribution(),
                "histogram": {},
                "reasons": {},
            },
            "generator_lag_ms": Distribution(),
            "load_avg_1m": 0.0,
            "ttft_samples_ms": {},
        }
    )


def test_slo_rate_is_the_top_of_the_passing_prefix() -> None:
    policy = PolicyReport(
        name="p",
        kind="pipeline",
        available=True,
        runs=[_run(10, 100), _run(50, 400), _run(100, 900), _run(200, 300)],
    )
    result = slo_result(policy, 500)
    # 200/s passing after 100/s failed is noise, not capacity.
    assert (result.highest_passing_rps, result.first_failing_rps) == (50, 100)
    unanswered = PolicyReport(
        name="p", kind="pipeline", available=True, runs=[_run(10, 100, completed=9)]
    )
    assert slo_result(unanswered, 500).highest_passing_rps is None


@pytest.mark.kafka
def test_bench_run_drives_the_openai_api_beside_the_websocket(
    stack: Stack, bootstrap: str, tmp_path: Path
) -> None:
    out = tmp_path / "run.json"
    _bench(
        "run",
        "--url",
        stack.ws_url,
        "--api",
        "ws,openai",
        "--rates",
        "4",
        "--duration",
        "2",
        "--json",
        str(out),
        bootstrap=bootstrap,
    )
    report = json.loads(out.read_text())
    _check_report(report)
    assert [p["name"] for p in report["policies"]] == ["target", "target/openai"]
    for policy in report["policies"]:
        (run,) = policy["runs"]
        assert run["completed"] == run["sent"] > 0, run["errors"]
        everyone = run["tiers"]["all"]
        for name in ("ttft_ms", "e2e_ms", "tpot_ms"):
            assert everyone[name]["count"] == run["completed"], name
        assert everyone["output_tokens"] > 0


def test_openai_load_sends_each_planned_request_as_its_openai_body() -> None:
    from bench.openai_load import http_target, openai_request

    assert http_target("ws://bench:KEY@127.0.0.1:8000/v1/chat") == ("http://127.0.0.1:8000", "KEY")
    assert http_target("http://127.0.0.1:9/v1") == ("http://127.0.0.1:9", None)
    chat = {
        "type": "chat.request",
        "client_id": "c",
        "messages": [{"role": "user", "content": "a"}],
        "max_tokens": 5,
        "priority": "background",
    }
    path, body = openai_request(chat)
    assert path == "/v1/chat/completions"
    assert body == {
        "messages": [{"role": "user", "content": "a"}],
        "max_tokens": 5,
        "priority": "background",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    path, body = openai_request({"type": "chat.request", "prompt": "p", "max_tokens": 3})
    assert (path, body["prompt"], body["max_tokens"]) == ("/v1/completions", "p", 3)


# The capacity benchmark (`make bench`, issue 12): `--quick` end to end, and its pure parts.

CAPACITY_KEYS = {
    "created_at",
    "command",
    "commit_source",
    "machine",
    "broker",
    "slo_ms",
    "fast_profile",
    "workload",
    "duration_s",
    "policies",
    "overhead",
    "targets",
    "elapsed_s",
}
PIPELINE_PROCESSES = {"edge", "ingest", "scheduler", "worker", "broker", "loadgen"}


@pytest.mark.kafka
def test_bench_cache_answers_each_repeat_from_the_cache(bootstrap: str, tmp_path: Path) -> None:
    out, doc = tmp_path / "cache.json", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nA section someone else wrote.\n")
    _bench(
        "cache",
        "--prompts",
        "2",
        "--max-tokens",
        "8",
        "--json",
        str(out),
        "--docs",
        str(doc),
        "--log-dir",
        str(tmp_path / "logs"),
        bootstrap=bootstrap,
    )
    report = json.loads(out.read_text())
    samples = report["samples"]
    assert [len(samples[k]) for k in ("uncached", "cached")] == [2, 2]
    assert [t["cached"] for t in samples["uncached"]] == [False, False]
    assert [t["cached"] for t in samples["cached"]] == [True, True]
    assert [t["text"] for t in samples["cached"]] == [t["text"] for t in samples["uncached"]]
    assert report["hit_rate"] == 1.0
    text = doc.read_text()
    assert "A section someone else wrote." in text
    assert text.count("tokenbus-cache:begin") == text.count("tokenbus-cache:end") == 1


@pytest.mark.kafka
def test_bench_cold_start_holds_the_cold_request_until_its_worker_is_up(
    bootstrap: str, tmp_path: Path
) -> None:
    out, doc = tmp_path / "cold_start.json", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nA section someone else wrote.\n")
    _bench(
        "cold-start",
        "--requests",
        "3",
        "--cold",
        "1",
        "--json",
        str(out),
        "--docs",
        str(doc),
        "--log-dir",
        str(tmp_path / "logs"),
        bootstrap=bootstrap,
    )
    report = json.loads(out.read_text())
    ttft, (load_s,) = report["samples"]["ttft_ms"], report["samples"]["load_s"]
    assert [len(ttft[k]) for k in ("warm", "cold")] == [3, 1]
    # The cold request was answered only once its worker had loaded: it waited that long
    # (the worker's start counts from its process start, a moment after the request left).
    assert ttft["cold"][0] >= 0.9 * load_s * 1000 > max(ttft["warm"])
    text = doc.read_text()
    assert "A section someone else wrote." in text
    assert text.count("tokenbus-cold-start:begin") == text.count("tokenbus-cold-start:end") == 1


@pytest.mark.kafka
def test_bench_capacity_quick_measures_cpu_per_process(bootstrap: str, tmp_path: Path) -> None:
    out, doc = tmp_path / "capacity.json", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nA section someone else wrote.\n")
    _bench(
        "capacity",
        "--quick",
        "--shared-broker",
        "--overhead-warmup",
        "1",
        "--json",
        str(out),
        "--plots",
        str(tmp_path / "img"),
        "--docs",
        str(doc),
        "--log-dir",
        str(tmp_path / "logs"),
        bootstrap=bootstrap,
        timeout=420,  # ~60 s on a quiet 2-core machine; far more under load
    )
    report = json.loads(out.read_text())
    assert set(report) == CAPACITY_KEYS
    fixed, direct = report["policies"]
    assert (fixed["name"], direct["name"]) == ("fixed", "direct")
    for policy in (fixed, direct):
        assert not policy["failed"], policy["failed"]
        assert policy["runs"], policy["name"]
        for run in policy["runs"]:
            assert run["run"]["completed"] > 0, "no request completed: the run measured nothing"
            cpu = run["cpu"]
            assert cpu["requests"] == run["run"]["completed"]
            assert all(p["cpu_s"] >= 0 for p in cpu["processes"].values())
    # Every process of the pipeline is measured, the engine either apart or said to be in.
    assert set(fixed["cpu"]["processes"]) >= PIPELINE_PROCESSES
    assert "worker" in fixed["cpu"]["engine_in_worker"]
    assert set(direct["cpu"]["processes"]) >= {"direct", "loadgen"}
    assert fixed["idle"]["requests"] == 0
    assert set(fixed["idle"]["processes"]) >= PIPELINE_PROCESSES
    assert [o["policy"] for o in report["overhead"]] == ["fixed", "direct"]
    assert all(o["completed"] > 0 for o in report["overhead"])
    # The overhead counts a steady state: a warm-up at the same rate ran first, reported apart.
    for o in report["overhead"]:
        assert [w["duration_s"] for w in o["warmup"]] == [1], o["warmup"]
        assert o["warmup"][0]["completed"] > 0
        assert o["warmup"][0]["p50_ms"] is not None
    # The four targets of the issue are each judged (met or not), none left unmeasured.
    assert len(report["targets"]) == 4
    assert all(t["met"] is not None for t in report["targets"]), report["targets"]
    assert (tmp_path / "img" / "capacity_cpu.png").stat().st_size > 0
    text = doc.read_text()
    assert "A section someone else wrote." in text
    assert "tokenbus-capacity:begin" in text
    assert "img/capacity_cpu.png" in text


def test_rate_climb_goes_up_the_ladder_then_bisects() -> None:
    ladder = (25.0, 50.0, 100.0, 200.0)
    assert next_rate({}, ladder, 2) == 25.0
    assert next_rate({25.0: True, 50.0: True}, ladder, 2) == 100.0
    assert next_rate({25.0: True, 50.0: True, 100.0: False}, ladder, 2) == 75.0
    assert next_rate({25.0: True, 50.0: True, 100.0: False, 75.0: True}, ladder, 2) == 87.5
    done = {25.0: True, 50.0: True, 100.0: False, 75.0: True, 87.5: False}
    assert next_rate(done, ladder, 2) is None
    assert next_rate({25.0: False}, ladder, 1) == 12.5  # bisects down from the lowest rate
    assert next_rate(dict.fromkeys(ladder, True), ladder, 2) is None  # the ladder's top passed


def _capacity_run(rate: float, passed: bool) -> CapacityRun:
    summary = RunSummary.model_construct(offered_rps=rate, output_tokens_per_s=rate * 60)
    cpu = CpuWindow(window_s=1, requests=1, output_tokens=60, processes={}, load_average=[0.0])
    return CapacityRun.model_construct(run=summary, cpu=cpu, passed=passed)


def test_ceiling_is_the_top_of_the_passing_prefix() -> None:
    runs = [_capacity_run(r, ok) for r, ok in ((25, True), (50, True), (100, False), (75, True))]
    best, failing = ceiling(runs)
    assert best is not None
    assert (best.run.offered_rps, failing) == (75, 100)
    # A lucky pass above a failure does not count.
    best, failing = ceiling([_capacity_run(25, False), _capacity_run(50, True)])
    assert (best, failing) == (None, 25)


def test_cpu_window_divides_by_requests_and_tokens() -> None:
    start = Reading(at=10.0, cpu={"edge": 1.0, "worker": 2.0, "gone": 1.0}, engine=5.0)
    end = Reading(at=12.0, cpu={"edge": 1.5, "worker": 3.0, "gone": None}, engine=5.25)
    cpu = window(start, end, requests=100, output_tokens=5000)
    assert set(cpu.processes) == {"edge", "worker", "engine"}  # a process gone is left out
    assert cpu.processes["edge"].ms_per_request == 5.0
    assert cpu.processes["edge"].ms_per_1k_tokens == 100.0
    assert cpu.processes["edge"].share_of_core == 0.25
    # The engine's own counter is taken out of the worker and shown apart.
    assert cpu.processes["worker"].cpu_s == 0.75
    assert cpu.processes["engine"].cpu_s == 0.25
    assert "apart" in cpu.engine_in_worker


def test_proc_readings_of_real_processes() -> None:
    assert (cpu_seconds(os.getpid()) or 0) > 0
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert listening_pid(server.getsockname()[1]) == os.getpid()


def test_targets_say_by_how_much() -> None:
    assert _by(12.0, 5.0) == "missed by 2.4x (+7.00)"
    assert _by(4.0, 5.0) == "met, 20% under"
    assert _by(None, 5.0) == "-"


def test_top_frames_of_a_flame_graph(tmp_path: Path) -> None:
    """Self samples: a frame's own width less its children's; waits are left out."""

    def frame(name: str, x: int, w: int, y: int) -> str:
        return (
            f'<g><title>{name} ({w} samples, 1%)</title><rect x="0" y="{y}" width="1%" '
            f'height="15" fg:x="{x}" fg:w="{w}"/></g>'
        )

    svg = tmp_path / "f.svg"
    svg.write_text(
        '<svg xmlns="http://www.w3.org/2000/svg" xmlns:fg="http://github.com/jonhoo/inferno">'
        + frame("all", 0, 100, 20)
        + frame("run (a.py:1)", 0, 100, 36)
        + frame("parse (b.py:10)", 0, 30, 52)
        + frame("parse (b.py:12)", 30, 10, 52)
        + frame("EpollSelector.select (selectors.py:468)", 40, 50, 52)
        + "</svg>"
    )
    samples, top = top_frames(svg, 5)
    assert samples == 50  # 100 less the 50 waiting in select
    assert [(f.frame, f.samples) for f in top] == [("parse (b.py)", 40), ("run (a.py)", 10)]
    assert top[0].share == 0.8


def test_the_overhead_warm_up_runs_in_windows_as_long_as_the_counted_run() -> None:
    def windows(warmup_s: float) -> list[float]:
        return warmup_windows(CapacityOptions(overhead_warmup_s=warmup_s, overhead_duration_s=10.0))

    assert windows(30) == [10, 10, 10]
    assert windows(25) == [10, 10, 5]
    assert windows(0) == []


@pytest.mark.kafka
def test_bench_cascade_escalates_the_declined_prompts_and_prices_each_arm(
    bootstrap: str, tmp_path: Path
) -> None:
    out, doc, plot = tmp_path / "cascade.json", tmp_path / "benchmarks.md", tmp_path / "c.png"
    doc.write_text("# Benchmarks\n\nA section someone else wrote.\n")
    _bench(
        "cascade",
        *("--requests", "20", "--concurrency", "4", "--refuse-share", "0.3"),
        *("--json", str(out), "--plot", str(plot), "--docs", str(doc)),
        *("--log-dir", str(tmp_path / "logs")),
        bootstrap=bootstrap,
    )
    report = json.loads(out.read_text())
    rows, samples = report["summary"], report["samples"]
    assert set(rows) == {"large only", "small only", "cascade"}
    assert {s["model"] for s in samples["large only"]} == {"large"}
    # Exactly the declined prompts went on to the large model, each after one reset.
    escalated = [s for s in samples["cascade"] if s["discarded"]]
    assert escalated
    assert all(s["model"] == "large" and len(s["discarded"]) == 1 for s in escalated)
    assert rows["cascade"]["escalated"] == len(escalated)
    assert rows["large only"]["gpu_s"] > rows["cascade"]["gpu_s"] > rows["small only"]["gpu_s"]
    assert rows["cascade"]["quality"] > rows["small only"]["quality"]
    assert plot.stat().st_size > 0
    text = doc.read_text()
    assert "A section someone else wrote." in text
    assert text.count("tokenbus-cascade:begin") == text.count("tokenbus-cascade:end") == 1
