"""`TOKENBUS_LOG_FORMAT`: the same events as `key=value` lines or as JSON objects."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.worker_logs import parse_line

pytestmark = pytest.mark.integration

# What a service does at start: settings from the environment, then logging, then events.
PROGRAM = """
import structlog
from shared.logs import configure_logging
from shared.settings import TokenbusSettings

s = TokenbusSettings()
configure_logging("scheduler", s.log_level, s.log_format)
structlog.get_logger().info("batch.sent", batch_id="b-1", size=3, note="it's \\"quoted\\"")
"""


def run(log_format: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TOKENBUS_LOG_FORMAT"}
    if log_format is not None:
        env["TOKENBUS_LOG_FORMAT"] = log_format
    return subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=False
    )


def test_json_format_writes_one_object_per_line() -> None:
    out = run("json")
    assert out.returncode == 0, out.stderr
    [line] = out.stderr.splitlines()
    event = json.loads(line)
    assert event["event"] == "batch.sent"
    assert (event["service"], event["level"], event["batch_id"], event["size"]) == (
        "scheduler",
        "info",
        "b-1",
        3,
    )
    assert event["note"] == 'it\'s "quoted"'
    assert event["timestamp"].endswith("Z")


def test_console_format_is_the_default_key_value_line() -> None:
    for fmt in (None, "console"):
        out = run(fmt)
        assert out.returncode == 0, out.stderr
        [line] = out.stderr.splitlines()
        assert line.split(" ")[1:3] == ["level='info'", "event='batch.sent'"], line
        fields = parse_line(line)
        assert (fields["service"], fields["batch_id"], fields["size"]) == ("scheduler", "b-1", 3)


def test_an_unknown_format_is_refused_at_start() -> None:
    out = run("xml")
    assert out.returncode != 0
    assert "log_format" in out.stderr
    assert "'json' or 'console'" in out.stderr
