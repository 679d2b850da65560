"""Every bench script that needs no broker, run short from its own command line: it still
runs, writes what it says, and its figures hang together. (The ones that need a broker or
a stack are run by test_bench_smoke.py, test_bench_affinity.py, test_fairness_stack.py and
test_worker_coalescing.py; `tokenbus bench real` and `vllm-serve` need vLLM.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import scheduler, span_cost
from bench.static_docs import BEGIN, END
from tokenbus.cli import main as tokenbus


def test_bench_scheduler_measures_throughput_the_cost_fit_and_load(tmp_path: Path) -> None:
    out = tmp_path / "scheduler.json"
    args = ["--requests", "2000", "--seconds", "5", "--json", str(out)]
    assert scheduler.main(args) == 0
    report = json.loads(out.read_text())
    assert [(r["rule"], r["batching"]) for r in report["throughput"]] == [
        ("fixed", "pack"),
        ("fixed", "buckets"),
        ("adaptive", "pack"),
    ]
    assert all(r["per_second"] > 0 for r in report["throughput"])
    assert [f["prompt_tokens"] for f in report["fit"]] == [100, 300, 1000]
    assert len(report["load"]) == 6  # two rules at three loads
    rows = [row for run in report["load"] for row in run["tiers"].values() if row]
    assert sum(row["requests"] for row in rows) > 100
    for row in rows:
        assert 0 <= row["ttft_ms_p50"] <= row["ttft_ms_p99"]
        # Every request's TTFT holds its wait for a batch, so the p99s keep that order.
        assert 0 <= row["wait_ms_p99"] <= row["ttft_ms_p99"]


def test_bench_span_cost_times_each_tracing_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert span_cost.main(["--requests", "20", "--ratio", "0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    timed = {
        m[1]: float(m[2])
        for line in lines
        if (m := re.match(r"(\S+(?: [\d.]+)?)\s+([\d.]+)$", line))
    }
    assert set(timed) == {"off", "on", "sampled 0.5"}
    assert all(us > 0 for us in timed.values())


def test_tokenbus_bench_static_writes_its_json_and_docs_block(tmp_path: Path) -> None:
    out, doc = tmp_path / "static.json", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkept\n")
    argv = ["bench", "static", "--seconds", "12", "--json", str(out), "--docs", str(doc)]
    assert tokenbus(argv) == 0
    report = json.loads(out.read_text())
    assert report["highest_rate"]["fixed"] > report["highest_rate"]["batch1"] > 0
    assert all(r["ttft_ms_p50"] <= r["ttft_ms_p99"] for r in report["runs"] if r["requests"])
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n")
    assert text.count(BEGIN) == text.count(END) == 1
