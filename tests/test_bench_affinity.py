"""`tokenbus bench affinity` in miniature: both routings run, and the outputs are written."""

from __future__ import annotations

import json
from pathlib import Path

from bench.affinity import BEGIN, END, AffinityOptions, affinity, write_outputs


async def test_a_short_run_measures_both_routings_and_writes_its_block(tmp_path: Path) -> None:
    options = AffinityOptions(
        workers=2, rate=4.0, duration_s=3.0, warmup_s=0.5, drain_s=10.0, turns=(3, 4), think_s=0.2
    )
    report = await affinity(options, say=lambda _: None)
    by = {r.mode: r for r in report.results}
    assert set(by) == {"prefix", "least_loaded"}
    assert all(r.turns > 0 for r in by.values())
    assert by["prefix"].hit_rate > 0  # later turns find earlier ones
    assert {t["target"].split(" ")[0] for t in report.targets} == {"prefix-cache", "TTFT"}
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    write_outputs(report, tmp_path / "affinity.json", None, doc)
    text = doc.read_text()
    assert "old" not in text
    assert "| `prefix` |" in text
    assert text.endswith("after\n")
    assert json.loads((tmp_path / "affinity.json").read_text())["results"]
