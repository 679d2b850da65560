"""How long this worker took to start: process start to ready, what a cold start of its model costs.

The worker reports it in every heartbeat (`Heartbeat.load_s`); the schedulers keep each
model's latest as the wait a request for a model with no live worker would face
(services/scheduler/cold_start.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# Where /proc cannot say (not Linux): the import of this module, with the worker's own
# modules (the interpreter's start and the first imports then go uncounted).
_IMPORTED_AT = time.time()


def process_started_at(proc: Path = Path("/proc")) -> float:
    """When this process started (Unix seconds): the kernel's record on Linux (its start in
    clock ticks after boot, /proc/self/stat, against the time since boot, /proc/uptime), so
    the interpreter's start and every import count; elsewhere when this module was imported."""
    try:
        now, uptime_s = time.time(), float((proc / "uptime").read_text().split()[0])
        # The command name (field 2) may hold spaces: the fields after it follow its ")".
        after_name = (proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
        started_s = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    except (OSError, IndexError, ValueError):
        return _IMPORTED_AT
    return now - (uptime_s - started_s)


def load_seconds(now: float, started_at: float) -> float:
    """Seconds from the process's start to `now` (never negative: clocks may step)."""
    return max(0.0, now - started_at)
