"""Reading a worker process's structured log lines: bench/service_logs.py's, shared with the
bench, with the bench's sample summary (bench/stats.py) under its old name here."""

from __future__ import annotations

from bench.service_logs import events, parse_line
from bench.stats import percentiles as distribution

__all__ = ["distribution", "events", "parse_line"]
