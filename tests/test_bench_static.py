"""The static-batch benchmark (bench/static.py): a short run, its findings and its docs block."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from bench import static, static_live
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


def test_the_live_climb_goes_up_then_bisects_to_its_resolution() -> None:
    ladder = (3.0, 4.5, 6.0)
    assert static_live.next_rate({}, ladder) == 3.0
    assert static_live.next_rate({3.0: True}, ladder) == 4.5
    assert static_live.next_rate({3.0: True, 4.5: True, 6.0: True}, ladder) is None
    # The first failure: bisect between the highest pass below it and it, twice at most.
    assert static_live.next_rate({3.0: True, 4.5: False}, ladder) == 3.75
    assert static_live.next_rate({3.0: True, 4.5: False, 3.75: True}, ladder) == 4.12
    assert static_live.next_rate({3.0: True, 4.5: False, 3.75: True, 4.12: True}, ladder) is None
    # Nothing passed: bisect towards 0.
    assert static_live.next_rate({3.0: False}, ladder) == 1.5
    # Closer than the resolution: done.
    assert static_live.next_rate({3.0: True, 3.2: False}, (3.0, 3.2)) is None


def _fake_run(rate: float, passed: bool) -> static_live.LiveRun:
    """A made-up run (no stack): only what ceiling() and the docs block read."""
    hops = {"edge_to_ingest": 10.0, "engine_first_token": 8.0}
    return static_live.LiveRun(
        "fixed",
        rate,
        10,
        10,
        90.0,
        400.0 if passed else 900.0,
        passed,
        1.5,
        7,
        hops,
        hops,
        3.5,
        {"workers": 0.4},
        300.0,
    )


def test_the_live_ceilings_decide_the_bus_rule_target(tmp_path: Path) -> None:
    runs = [_fake_run(8.0, True), _fake_run(16.0, False), _fake_run(12.0, True)]
    assert static_live.ceiling(runs) == (12.0, 16.0)
    assert static_live.ceiling([_fake_run(3.0, False)]) == (0.0, 3.0)
    # A failure run again that passes: the rate passes.
    assert static_live.ceiling([*runs, _fake_run(16.0, True)]) == (16.0, None)
    report = static.run_all(seconds=10.0, slo_ms=500.0, command="test")
    simulated = report.targets[0]
    missed = static.bus_rule_live(simulated, batch1=4.0, fixed=12.0)
    assert not missed.holds
    assert "3.0x" in missed.measured
    assert "missed by 1.33x" in missed.measured
    assert simulated.measured in missed.measured  # the prediction stays beside it
    met = static.bus_rule_live(simulated, batch1=2.0, fixed=12.0)
    assert met.holds
    report.targets[0] = met
    climb = static_live.LiveClimb("fixed", 4, 30.5, 12.0, 16.0, runs)
    report.live = [asdict(climb)]
    doc = tmp_path / "benchmarks.md"
    write_section(report, doc, None)
    text = doc.read_text()
    assert "| fixed | 12 | 16 | 30.5 |" in text
    assert "(live, real stacks)" in text
