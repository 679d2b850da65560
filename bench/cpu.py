"""CPU time per process from `/proc`, sampled over one window, and the worker's engine share.

Linux only: every figure is `utime + stime` of `/proc/<pid>/stat` (all threads of the
process), in seconds, read at the window's start and end. The broker is found by the
port it listens on; the load generator is the bench's own process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

TICKS = os.sysconf("SC_CLK_TCK")
# The worker's counter of CPU seconds spent inside the engine (sim or real), if it has one.
ENGINE_CPU_METRIC = "tokenbus_worker_engine_cpu_seconds_total"
_METRIC_LINE = re.compile(rf"^{ENGINE_CPU_METRIC}(?:{{[^}}]*}})?\s+([0-9.eE+-]+)", re.MULTILINE)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` so far; None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = raw.rsplit(")", 1)[1].split()
    # Fields 14 and 15 of stat (utime, stime) are the 12th and 13th after the name.
    return (int(fields[11]) + int(fields[12])) / TICKS


def listening_pid(port: int) -> int | None:
    """The process listening on TCP `port` of this machine (e.g. the broker), if visible."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(inode)
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        return int(entry.name)
    return None


def engine_cpu_seconds(metrics_url: str | None) -> float | None:
    """The worker's engine CPU counter from its `/metrics`, or None if it has none."""
    if metrics_url is None:
        return None
    try:
        with urllib.request.urlopen(metrics_url, timeout=2.0) as response:
            text = response.read().decode()
    except OSError:
        return None
    found = _METRIC_LINE.findall(text)
    return sum(float(v) for v in found) if found else None


class ProcessCpu(BaseModel):
    """One process's CPU over the window, absolute and per unit of work."""

    model_config = ConfigDict(extra="forbid")

    cpu_s: float
    share_of_core: float
    ms_per_request: float | None
    ms_per_1k_tokens: float | None


class CpuWindow(BaseModel):
    """CPU of every measured process over one window of a run."""

    model_config = ConfigDict(extra="forbid")

    window_s: float
    requests: int  # completed within the window: the denominator of `ms_per_request`
    sent: int | None = None  # sent within the window; far above `requests`: not steady
    output_tokens: int
    processes: dict[str, ProcessCpu]
    engine_in_worker: str = ""  # how the worker's engine time is reported
    load_average: list[float]


@dataclass(frozen=True)
class Reading:
    """Every process's CPU seconds so far (None: gone), and the worker's engine counter."""

    at: float  # time.monotonic()
    cpu: dict[str, float | None]
    engine: float | None


@dataclass(frozen=True)
class CpuSampler:
    """The processes one run measures: `read()` before and after, then `window()`."""

    pids: Mapping[str, int]
    worker_metrics_url: str | None = None

    def read(self) -> Reading:
        cpu = {k: cpu_seconds(p) for k, p in self.pids.items()}
        cpu["loadgen"] = time.process_time()  # this process: the load generator
        return Reading(time.monotonic(), cpu, engine_cpu_seconds(self.worker_metrics_url))

    def engine_caught_up(self, reading: Reading) -> Reading:
        """`reading` with the engine counter read again now (it is published periodically)."""
        return dataclasses.replace(reading, engine=engine_cpu_seconds(self.worker_metrics_url))


def window(
    start: Reading, end: Reading, requests: int, output_tokens: int, sent: int | None = None
) -> CpuWindow:
    """CPU per process between two readings, per request and per 1,000 output tokens."""
    span = end.at - start.at
    used = {
        k: e - s
        for k, s in start.cpu.items()
        if s is not None and (e := end.cpu.get(k)) is not None
    }
    note = ""
    if "worker" in used:
        note = f"worker: the whole process ({ENGINE_CPU_METRIC} not on its /metrics)"
        if start.engine is not None and end.engine is not None:
            used["worker"] -= end.engine - start.engine
            used["engine"] = end.engine - start.engine
            note = f"worker: engine time ({ENGINE_CPU_METRIC}) reported apart as `engine`"
    return CpuWindow(
        window_s=round(span, 2),
        requests=requests,
        sent=sent,
        output_tokens=output_tokens,
        processes={k: per_unit(v, span, requests, output_tokens) for k, v in used.items()},
        engine_in_worker=note,
        load_average=[round(v, 2) for v in os.getloadavg()],
    )


def per_unit(cpu_s: float, window_s: float, requests: int, tokens: int) -> ProcessCpu:
    return ProcessCpu(
        cpu_s=round(cpu_s, 3),
        share_of_core=round(cpu_s / window_s, 4) if window_s > 0 else 0.0,
        ms_per_request=round(cpu_s * 1000 / requests, 4) if requests else None,
        ms_per_1k_tokens=round(cpu_s * 1e6 / tokens, 4) if tokens else None,
    )
