"""Process and port helpers for tests that run real processes (Linux /proc, no psutil)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from bench.ports import free_port, free_port_pair, free_port_run

__all__ = ["cmdline", "descendants", "free_port", "free_port_pair", "free_port_run", "running"]


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
