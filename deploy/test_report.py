"""`make test`'s closing table: each tier's minutes, the slowest tests, and what the run
started (stacks, JVM nodes, model loads).

deploy/test.sh writes what it reads: one line per tier it timed (`tier seconds status` in
`phases`), pytest's JUnit XML of each run (each test's setup, call and teardown: a module
fixture's start is in its first test), and the ledger of starts (deploy/test_ledger.py).
Prints the table and writes it as JSON beside them. Stdlib only.

    python -m deploy.test_report --dir .tokenbus/test-run
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from deploy import test_ledger

SLOWEST = 25
CHAOS_MODULE = "tests.test_chaos"  # JUnit's classname: the module, dotted (a class after it)
# The tiers in the order the run meets them: `broker` (two workers), then `cluster` less the
# chaos check, and `chaos` (with arguments, one run: `broker` is it less the chaos check).
TIER_ORDER = (
    "venv", "lint", "unit", "setup", "builds wait", "broker", "cluster", "chaos", "real engine",
    "tool builds", "jaeger build",
)  # fmt: skip
BESIDE = ("tool builds", "jaeger build")  # run in the background: not added to the total
COUNTED = {
    test_ledger.STACK: "stack starts",
    test_ledger.JVM_NODE: "JVM node starts",
    test_ledger.VLLM_LOAD: "vLLM loads",
    test_ledger.TRANSFORMERS_LOAD: "transformers loads",
}


@dataclass(frozen=True)
class TestTime:
    nodeid: str
    seconds: float
    outcome: str


@dataclass(frozen=True)
class Tier:
    name: str
    seconds: float
    status: str  # "ok", "failed", "n/a" (not run) or a note


def read_phases(path: Path) -> dict[str, Tier]:
    tiers: dict[str, Tier] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            name, seconds, status = line.split("\t")
            tiers[name] = Tier(name, float(seconds), status)
    return tiers


def read_junit(path: Path, suite: str) -> list[TestTime]:
    """Every test case of a JUnit XML file, its time and outcome; `suite` names the run."""
    if not path.exists():
        return []
    found: list[TestTime] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{_without_group(case.get('name', ''))}"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        found.append(TestTime(f"{suite}{name}", float(case.get("time", 0.0)), outcome))
    return found


def _without_group(name: str) -> str:
    """A test's name less the `@group` pytest-xdist's loadgroup appends (after any
    parameters' `]`)."""
    at = name.rfind("@")
    return name[:at] if at > name.rfind("]") else name


# Of the JVM node starts, those of a node (its state dir) started before in the run: a fault
# test's node brought back after a kill -9 or a stop, the fault itself.
RESTARTS = "JVM node restarts"


def read_ledger(path: Path) -> Counter[str]:
    """Each kind's starts; and RESTARTS, the JVM node starts of a node seen before."""
    counts: Counter[str] = Counter()
    nodes: set[str] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                counts[entry["kind"]] += int(entry["count"])
                if entry["kind"] == test_ledger.JVM_NODE:
                    counts[RESTARTS] += entry["where"] in nodes
                    nodes.add(entry["where"])
    return counts


def is_chaos(test: TestTime) -> bool:
    module = test.nodeid.split("::")[0]
    return module == CHAOS_MODULE or module.startswith(CHAOS_MODULE + ".")


def split_chaos(tiers: dict[str, Tier], tests: list[TestTime], run: str, rest: str) -> None:
    """The wall time of the run `run` that held the chaos check, split: the chaos check's
    tests, and the rest (tier `rest`)."""
    whole = tiers.pop(run, None)
    if whole is None:
        return
    chaos = sum(t.seconds for t in tests if is_chaos(t))
    chaos_failed = any(is_chaos(t) and t.outcome != "passed" for t in tests)
    rest_failed = any(not is_chaos(t) and t.outcome in ("failure", "error") for t in tests)
    failed = rest_failed or whole.status != "ok"
    tiers[rest] = Tier(rest, whole.seconds - chaos, "failed" if failed else "ok")
    tiers["chaos"] = Tier("chaos", chaos, "failed" if chaos_failed else "ok")


def report(run_dir: Path) -> dict[str, object]:
    # `make test`: the broker tier, then the cluster's (the chaos check in it); with
    # arguments, one run (main).
    main_tests = read_junit(run_dir / "junit-main.xml", "")
    broker_tests = read_junit(run_dir / "junit-broker.xml", "")
    cluster_tests = read_junit(run_dir / "junit-cluster.xml", "")
    real_tests = read_junit(run_dir / "junit-real.xml", "[real] ")
    tiers = read_phases(run_dir / "phases.tsv")
    split_chaos(tiers, main_tests, "main", "broker")
    split_chaos(tiers, cluster_tests, "cluster", "cluster")
    counts = read_ledger(run_dir / "ledger.jsonl")
    everything = main_tests + broker_tests + cluster_tests + real_tests
    tests = sorted(everything, key=lambda t: t.seconds, reverse=True)
    ordered = [tiers[n] for n in TIER_ORDER if n in tiers]
    ordered += [t for n, t in tiers.items() if n not in TIER_ORDER]
    return {
        "tiers": [asdict(t) for t in ordered],
        "total_s": sum(t.seconds for t in ordered if t.name not in BESIDE),
        "tests": len(tests),
        "slowest": [asdict(t) for t in tests[:SLOWEST]],
        "counts": {COUNTED.get(k, k): counts.get(k, 0) for k in [*COUNTED, RESTARTS]},
    }


def render(data: dict[str, object]) -> str:
    tiers = data["tiers"]
    slowest = data["slowest"]
    counts = data["counts"]
    assert isinstance(tiers, list)
    assert isinstance(slowest, list)
    assert isinstance(counts, dict)
    out = ["", "make test: minutes per tier", "", "| tier | minutes | status |", "|---|---:|---|"]
    out += [f"| {t['name']} | {t['seconds'] / 60:.1f} | {t['status']} |" for t in tiers]
    total = float(str(data["total_s"]))
    out += [f"| **total** (tool builds run beside) | **{total / 60:.1f}** | |", ""]
    out += [f"the {len(slowest)} slowest of {data['tests']} tests (setup + call + teardown):", ""]
    out += ["| s | test |", "|---:|---|"]
    out += [f"| {t['seconds']:.1f} | {t['nodeid']} |" for t in slowest]
    of_them = f" ({counts.get(RESTARTS, 0)} of them restarts of a node after a fault)"
    started = [
        f"{v} {k}" + (of_them if k == COUNTED[test_ledger.JVM_NODE] else "")
        for k, v in counts.items()
        if k != RESTARTS
    ]
    out += ["", "started: " + ", ".join(started), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="the run's files (test.sh)")
    args = parser.parse_args(argv)
    data = report(args.dir)
    (args.dir / "report.json").write_text(json.dumps(data, indent=2) + "\n")
    print(render(data), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
