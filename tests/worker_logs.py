"""Reading a worker process's structured log lines (key=value, as shared.logs renders them)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from bench.stats import percentile

_PAIR = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S+)")


def parse_line(line: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, raw in _PAIR.findall(line):
        try:
            fields[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            fields[key] = raw
    return fields


def events(log: Path, name: str) -> list[dict[str, Any]]:
    """Every line of `log` whose event is `name`, parsed."""
    if not log.exists():
        return []
    return [parse_line(line) for line in log.read_text().splitlines() if f"event='{name}'" in line]


def distribution(values: list[float]) -> dict[str, float]:
    """n, min, p50, p90, p99, max of a sample (the bench's percentile, bench/stats.py)."""
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "min": ordered[0],
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "max": ordered[-1],
    }
