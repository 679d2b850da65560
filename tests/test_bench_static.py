"""The static-batch benchmark (bench/static.py): a short run, its findings and its docs block."""

from __future__ import annotations

from pathlib import Path

from bench import static
from bench.static_docs import BEGIN, END, write_section
from services.worker.engines.sim_profiles import sim_profile


def test_a_short_run_finds_what_static_batching_predicts(tmp_path: Path) -> None:
    report = static.run_all(seconds=20.0, slo_ms=500.0, command="test")
    assert report.highest_rate["batch1"] < report.highest_rate["fixed"]
    assert report.saturation_rps["batch1"] < report.saturation_rps["fixed"]
    pack, buckets = report.buckets
    assert buckets.padded_share < pack.padded_share
    assert {t.name.split(":")[0] for t in report.targets} == {"bus rule", "buckets", "adaptive"}
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkept\n")
    write_section(report, doc, None)
    write_section(report, doc, None)  # rewritten in place, not appended twice
    text = doc.read_text()
    assert text.count(BEGIN) == 1
    assert text.count(END) == 1
    assert "kept" in text


def test_every_request_is_answered_once_with_its_batch_padded() -> None:
    profile = sim_profile(static.PROFILE, max_num_seqs=static.SLOTS, token_rate=50.0)
    run = static.simulate(static.POLICIES["fixed"], profile, rate=40.0, seconds=10.0)
    assert run.requests > 0
    assert 1 <= run.batch_size_mean <= static.SLOTS
    assert 0 < run.padded_share < 1
    alone = static.simulate(static.POLICIES["batch1"], profile, rate=2.0, seconds=10.0)
    assert alone.batch_size_mean == 1
    assert alone.padded_share == 0
