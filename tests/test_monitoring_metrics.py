"""The four real services' /metrics after a request: `promtool check metrics` passes on
each, and every PromQL expression of the Grafana dashboard and of the rules parses and
names only metrics the services export (or the rules record)."""

from __future__ import annotations

import asyncio
import re
import subprocess

import pytest
import websockets
import yaml

from tests.built_tools import WAITS_FOR_BUILD
from tests.chat_client import run_requests
from tests.k8s_tools import run, tool
from tests.stack import SERVICES, Stack
from tests.test_monitoring import RULES, dashboard_queries

pytestmark = [pytest.mark.kafka, WAITS_FOR_BUILD]

PROBE = "tokenbus_probe"
# Series Prometheus makes itself for every target.
SCRAPE_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


@pytest.fixture(scope="module")
def scraped(stack: Stack) -> dict[str, str]:
    """service -> its /metrics text, after one chat request went through all four (the
    session's shared stack's)."""
    tool("promtool")  # waited for here, if make test is still building it

    async def one_request() -> None:
        async with websockets.connect(stack.ws_url) as ws:
            got = await run_requests(ws, [{"client_id": "c", "prompt": "hi", "max_tokens": 4}])
        assert got["c"].final is not None
        assert got["c"].final["type"] == "chat.done"

    asyncio.run(one_request())
    return {name: stack.metrics(name) for name in SERVICES}


@pytest.mark.parametrize("service", SERVICES)
def test_promtool_check_metrics_passes(scraped: dict[str, str], service: str) -> None:
    text = scraped[service]
    assert "tokenbus_" in text
    done = subprocess.run(
        [str(tool("promtool")), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"{service}:\n{done.stdout}{done.stderr}"


def exported(scraped: dict[str, str]) -> set[str]:
    """Every series name the services expose, from their `# TYPE` lines."""
    names = set(SCRAPE_SERIES)
    for text in scraped.values():
        for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def recorded() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["record"] for g in groups for r in g["rules"] if "record" in r}


def selected(query: str) -> set[str]:
    """The metric names a PromQL expression selects, as Prometheus's own parser reads it:
    promtool adds a marker matcher to every vector selector and prints the expression."""
    out = run([str(tool("promtool")), "--experimental", "promql", "label-matchers", "set",
               query, PROBE, "1"])  # fmt: skip
    names = set(re.findall(rf'([A-Za-z_:][A-Za-z0-9_:]*)\{{[^}}]*\b{PROBE}="1"', out))
    by_name_label = re.findall(rf'\{{[^}}]*__name__="([^"]+)"[^}}]*\b{PROBE}="1"', out)
    return names | set(by_name_label)


def expressions() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [(r.get("record") or r["alert"], r["expr"]) for g in groups for r in g["rules"]]
    return dashboard_queries() + rules


def test_every_dashboard_and_rule_expression_parses_and_names_exported_metrics(
    scraped: dict[str, str],
) -> None:
    known = exported(scraped) | recorded()
    unknown = {}
    for where, query in expressions():
        names = selected(query)
        assert names, f"{where}: no metric selected in {query!r}"
        if names - known:
            unknown[where] = sorted(names - known)
    assert not unknown, unknown


def test_the_name_check_catches_a_metric_nobody_exports(scraped: dict[str, str]) -> None:
    names = selected("sum(rate(tokenbus_worker_tokenz_total[5m])) / sum(up)")
    assert names == {"tokenbus_worker_tokenz_total", "up"}
    assert "tokenbus_worker_tokenz_total" not in exported(scraped)
