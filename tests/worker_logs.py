"""Reading a worker process's structured log lines: bench/service_logs.py's, shared with the
bench, with the bench's sample summary (bench/stats.py) under its old name here."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from bench.service_logs import events, parse_line
from bench.stats import percentiles as distribution

__all__ = ["distribution", "events", "parse_line", "reruns"]


def reruns(logs: Iterable[Path]) -> set[str]:
    """The ids of requests these workers answered at an attempt after the first: run again
    after a loss (which the client no longer sees as a `chat.reset`: ADR 0071)."""
    return {
        e["request_id"]
        for log in logs
        for e in events(log, "request.finished")
        if e["attempt"] >= 1 and e["finish_reason"] != "cancelled"
    }
