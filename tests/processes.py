"""Process and port helpers for tests that run real processes (Linux /proc, no psutil)."""

from __future__ import annotations

import random
import socket
from collections import defaultdict
from pathlib import Path


def free_port_pair() -> int:
    """A port P with P+1 also free: the local broker listens on P, its controller on P+1."""
    return free_port_run(2)


def free_port_run(count: int) -> int:
    """A port P with P+1 … P+count-1 also free: a local cluster of count/2 nodes uses them.

    Drawn below the kernel's ephemeral range: a JVM binds its ports tens of seconds after
    the check on a loaded machine, and meanwhile any outgoing connection (the nodes' own,
    to each other) may be given a free ephemeral port.
    """
    low, _high = _ephemeral_range()
    for _ in range(500):
        port = random.randrange(10000, max(10001, low - count))
        if all(_bindable(port + i) for i in range(count)):
            return port
    raise RuntimeError(f"no {count} adjacent free ports found below {low}")


def _ephemeral_range() -> tuple[int, int]:
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


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (a zombie has finished; only unreaped)."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def descendants(pid: int) -> set[int]:
    """Every process below `pid` in the process tree, whatever session or group it is in."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children[int(_stat_fields(int(entry.name))[1])].append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited while we looked
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children[todo.pop()]:
            found.add(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return raw.decode(errors="replace").split("\0")[:-1]


def _stat_fields(pid: int) -> list[str]:
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name may hold spaces and parentheses: the fields start after the last ')'.
    return stat[stat.rindex(")") + 2 :].split()
