"""Free local ports for the processes a test or a bench starts, drawn so two never collide.

A port is checked free here and bound by another process seconds later (a JVM, on a loaded
machine, tens of seconds). Two things can take it in between, and both did in `make test`:

- any outgoing connection, which the kernel gives an ephemeral port: so ports are drawn
  below the kernel's ephemeral range, where only an explicit bind lands;
- another pytest-xdist worker drawing the same port: so each worker draws from its own band
  of that range (`PYTEST_XDIST_WORKER` gwN of `PYTEST_XDIST_WORKER_COUNT`).

Within one process a port handed out is not handed out again.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Mapping
from pathlib import Path

LOWEST = 10000
_handed_out: set[int] = set()


def free_port() -> int:
    """One free port."""
    return free_port_run(1)


def free_port_pair() -> int:
    """A port P with P+1 also free: a local broker listens on P, its controller on P+1."""
    return free_port_run(2)


def free_port_run(count: int) -> int:
    """A port P with P+1 … P+count-1 also free (a local cluster of nodes uses them)."""
    low, high = band()
    for _ in range(1000):
        port = random.randrange(low, max(low + 1, high - count))
        run = range(port, port + count)
        if not _handed_out.intersection(run) and all(_bindable(p) for p in run):
            _handed_out.update(run)
            return port
    raise RuntimeError(f"no {count} adjacent free ports found in {low}-{high}")


def band(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """This process's ports: [low, high), its xdist worker's share below the ephemeral range."""
    top = ephemeral_range()[0]
    worker, count = environ.get("PYTEST_XDIST_WORKER", ""), environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count and count.isdigit()):
        return LOWEST, top
    index, workers = int(worker[2:]), max(1, int(count))
    width = (top - LOWEST) // workers
    start = LOWEST + (index % workers) * width
    return start, start + width


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (FileNotFoundError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
