"""`make test`'s closing table (deploy/test_report.py) from files as deploy/test.sh writes
them, and the ledger of starts it counts (deploy/test_ledger.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy import test_ledger, test_report

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.test_chat_e2e" name="test_one" time="12.5"/>
<testcase classname="tests.test_chaos" name="test_the_system" time="240.0"/>
<testcase classname="tests.test_auth_e2e" name="test_two" time="3.0">
  <failure message="boom">boom</failure></testcase>
</testsuite></testsuites>
"""


def test_the_ledger_counts_each_start_in_the_file_the_environment_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = tmp_path / "ledger.jsonl"
    # Unset here even under `make test`, whose ledger this line must not reach.
    monkeypatch.delenv(test_ledger.LEDGER_ENV, raising=False)
    test_ledger.note(test_ledger.STACK)  # no ledger named: nothing written, no error
    monkeypatch.setenv(test_ledger.LEDGER_ENV, str(ledger))
    test_ledger.note(test_ledger.STACK, where="a")
    for node in ("node-1", "node-2", "node-3", "node-2"):  # node 2 killed and started again
        test_ledger.note(test_ledger.JVM_NODE, where=node)
    test_ledger.note(test_ledger.VLLM_LOAD, count=0)  # nothing started: no line
    counts = test_report.read_ledger(ledger)
    assert counts == {"stack": 1, "jvm_node": 4, test_report.RESTARTS: 1}
    assert test_ledger.engine_load("vllm") == test_ledger.VLLM_LOAD
    assert test_ledger.engine_load("transformers") == test_ledger.TRANSFORMERS_LOAD
    assert test_ledger.engine_load(None) is None


def test_the_table_splits_the_chaos_check_out_and_adds_no_background_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "phases.tsv").write_text(
        "lint\t30\tok\nunit\t60\tok\nsetup\t120\tok\nmain\t600\tfailed\n"
        "real engine\t180\tok\ntool builds\t900\tok\n"
    )
    (tmp_path / "junit-main.xml").write_text(JUNIT)
    monkeypatch.setenv(test_ledger.LEDGER_ENV, str(tmp_path / "ledger.jsonl"))
    test_ledger.note(test_ledger.STACK, count=2)

    data = test_report.report(tmp_path)

    tiers = {t["name"]: (t["seconds"], t["status"]) for t in data["tiers"]}  # type: ignore[attr-defined]
    assert tiers["chaos"] == (240.0, "ok")
    assert tiers["broker"] == (360.0, "failed")  # the main run less the chaos check
    assert "main" not in tiers
    assert [t["name"] for t in data["tiers"]][:6] == [  # type: ignore[attr-defined]
        "lint", "unit", "setup", "broker", "chaos", "real engine"
    ]  # fmt: skip
    assert data["total_s"] == 30 + 60 + 120 + 600 + 180  # the tool builds ran beside
    assert data["slowest"][0]["nodeid"] == "tests.test_chaos::test_the_system"  # type: ignore[index]
    assert data["counts"] == {
        "stack starts": 2, "JVM node starts": 0, "vLLM loads": 0, "transformers loads": 0,
        "JVM node restarts": 0,
    }  # fmt: skip
    table = test_report.render(data)
    assert "| chaos | 4.0 | ok |" in table
    assert "**16.5**" in table
    assert "started: 2 stack starts, 0 JVM node starts (0 of them restarts" in table


BROKER_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.test_chat_e2e" name="test_one" time="12.5"/>
<testcase classname="tests.test_auth_e2e" name="test_two[a@b]@tests/test_auth_e2e.py" time="3.0"/>
</testsuite></testsuites>
"""
CLUSTER_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.test_cluster" name="test_a_node" time="40.0"/>
<testcase classname="tests.test_chaos" name="test_the_system" time="200.0">
  <failure message="lost 1">lost 1</failure></testcase>
</testsuite></testsuites>
"""


def test_make_tests_two_runs_make_the_broker_cluster_and_chaos_tiers(tmp_path: Path) -> None:
    """`make test` without arguments: the broker tier (two workers) and the cluster's run,
    the chaos check split out of the latter."""
    (tmp_path / "phases.tsv").write_text(
        "unit\t60\tok\nbroker\t500\tok\ncluster\t260\tfailed\nreal engine\t180\tok\n"
    )
    (tmp_path / "junit-broker.xml").write_text(BROKER_JUNIT)
    (tmp_path / "junit-cluster.xml").write_text(CLUSTER_JUNIT)

    data = test_report.report(tmp_path)

    tiers = [(t["name"], t["seconds"], t["status"]) for t in data["tiers"]]  # type: ignore[attr-defined]
    assert tiers == [
        ("unit", 60.0, "ok"),
        ("broker", 500.0, "ok"),
        ("cluster", 60.0, "failed"),  # its run failed: the chaos check in it
        ("chaos", 200.0, "failed"),
        ("real engine", 180.0, "ok"),
    ]
    assert data["total_s"] == 60 + 500 + 260 + 180
    assert data["tests"] == 4
    assert data["slowest"][0]["nodeid"] == "tests.test_chaos::test_the_system"  # type: ignore[index]
    # The group pytest-xdist appends to a name is not shown; a parameter's `@` is.
    assert data["slowest"][-1]["nodeid"] == "tests.test_auth_e2e::test_two[a@b]"  # type: ignore[index]


def test_a_run_that_stopped_early_still_gets_a_table(tmp_path: Path) -> None:
    (tmp_path / "phases.tsv").write_text("lint\t31\tfailed\n")
    data = test_report.report(tmp_path)
    assert [(t["name"], t["status"]) for t in data["tiers"]] == [("lint", "failed")]  # type: ignore[attr-defined]
    assert test_report.main(["--dir", str(tmp_path)]) == 0
    assert (tmp_path / "report.json").exists()
