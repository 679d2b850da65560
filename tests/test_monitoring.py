"""deploy/monitoring checked by the real promtool: both Prometheus configs, the rules, and
the alert rules' unit tests. What the services export is checked in
tests/test_monitoring_metrics.py (a real stack)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.built_tools import WAITS_FOR_BUILD
from tests.k8s_tools import MONITORING, run, tool

DASHBOARD = MONITORING / "grafana" / "dashboards" / "tokenbus.json"
RULES = MONITORING / "rules" / "tokenbus.rules.yml"

pytestmark = WAITS_FOR_BUILD


@pytest.fixture(scope="module")
def promtool() -> Path:
    """promtool, waited for here if make test is still building it."""
    return tool("promtool")


@pytest.mark.integration
def test_prometheus_configs_pass_promtool_check_config(promtool: Path) -> None:
    for config in ("prometheus.yml", "prometheus-k8s.yml"):
        out = run([str(promtool), "check", "config", config], cwd=MONITORING)
        assert "SUCCESS" in out, out
        assert "rules/tokenbus.rules.yml" in out, out  # its rule file was read and checked


@pytest.mark.integration
def test_rules_pass_promtool_check_rules(promtool: Path) -> None:
    out = run([str(promtool), "check", "rules", "--lint-fatal", str(RULES)])
    groups = yaml.safe_load(RULES.read_text())["groups"]
    count = sum(len(g["rules"]) for g in groups)
    assert f"SUCCESS: {count} rules found" in out, out


@pytest.mark.integration
def test_alert_rules_unit_tests_pass(promtool: Path) -> None:
    out = run(
        [str(promtool), "test", "rules", "tokenbus.rules.test.yml"],
        cwd=MONITORING / "rules",
    )
    assert "SUCCESS" in out, out


def test_the_alerts_cover_slo_burn_dead_letters_dead_workers_and_lag() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    tested = yaml.safe_load((MONITORING / "rules" / "tokenbus.rules.test.yml").read_text())
    fired = {
        case["alertname"]
        for test in tested["tests"]
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    assert set(alerts) == fired, "every alert has a unit test in which it fires"
    assert (
        "tier:tokenbus_ttft_slo_errors:ratio_rate1h" in alerts["TokenbusTTFTBudgetBurnFast"]["expr"]
    )
    assert "tokenbus_dead_letters_total" in alerts["TokenbusDeadLettersGrowing"]["expr"]
    assert 'component="worker"' in alerts["TokenbusWorkerDown"]["expr"]
    assert "consumer_lag" in alerts["TokenbusConsumerLagHigh"]["expr"]
    assert "tokenbus_scheduler_rollbacks_total" in alerts["TokenbusCanaryRolledBack"]["expr"]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, with Grafana's interval variable filled in."""
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], re.sub(r"\$__rate_interval|\$__interval", "5m", target["expr"]))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def test_the_dashboard_shows_what_an_operator_needs() -> None:
    titles = " | ".join(title for title, _ in dashboard_queries())
    for needed in (
        "TTFT", "TPOT", "Queue depth", "Queue wait", "Batch size", "Batch fill", "Tokens/s",
        "Errors by code", "Consumer lag", "Worker slots", "Variant shares",
        "Variant TTFT p99", "Variant error rate", "Variant quality score", "rollbacks",
        "Batch progress", "Batch lines/s",
    ):  # fmt: skip
        assert needed in titles, needed
    tiers = [q for title, q in dashboard_queries() if title.startswith(("TTFT", "TPOT"))]
    assert all("by (tier, le)" in q for q in tiers)
