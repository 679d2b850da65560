"""A service process's structured log lines (key=value, as shared.logs renders them), read back.

Used by the benchmarks that read a worker's own account of its timing (bench/coalescing.py)
and by the tests that wait on, or count, a service's log events (tests/worker_logs.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

_PAIR = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S+)")


def parse_line(line: str) -> dict[str, Any]:
    """The `key=value` pairs of one log line; a value Python cannot read stays text."""
    fields: dict[str, Any] = {}
    for key, raw in _PAIR.findall(line):
        try:
            fields[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            fields[key] = raw
    return fields


def events(log: Path, name: str) -> list[dict[str, Any]]:
    """Every line of `log` whose event is `name`, parsed (none while `log` does not exist)."""
    if not log.exists():
        return []
    return [parse_line(line) for line in log.read_text().splitlines() if f"event='{name}'" in line]
