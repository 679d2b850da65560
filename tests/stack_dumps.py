"""Where every task of running services waits, read from their logs (shared/stacks.py): a
failing fault test puts it in its message, because CI keeps only the test output."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

THREAD_LINES = ("Thread ", "Current thread", "  File")
OWN_CODE = re.compile(r"/(services|shared|tokenbus)/")
# Cut from the paths shown: an interpreter's library directories, and this checkout's.
LIBRARY_DIRS = re.compile(r"/\S*?/lib/python3\.\d+/(site-packages/)?")
CHECKOUT = f"{Path(__file__).resolve().parent.parent}/"


def lines_since(path: Path, start: int) -> list[str]:
    """The lines a log got after its first `start` bytes."""
    with path.open("rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace").splitlines()


def dump_stacks(
    services: Mapping[str, tuple[subprocess.Popen[bytes], Path]], timeout_s: float = 10.0
) -> dict[str, list[str]]:
    """SIGUSR2 and SIGUSR1 to each running service (process, log), then what its log got
    since: threads' stacks (faulthandler, even with the loop blocked) and `task.stack` lines,
    by name."""
    logs: dict[str, tuple[Path, int]] = {}
    for name, (proc, path) in services.items():
        if proc.poll() is not None or not path.exists():
            continue
        logs[name] = (path, path.stat().st_size)
        os.kill(proc.pid, signal.SIGUSR2)  # threads, even with the loop blocked
        os.kill(proc.pid, signal.SIGUSR1)  # tasks
    stacks: dict[str, list[str]] = {}
    deadline = time.monotonic() + timeout_s
    while logs and time.monotonic() < deadline:
        for name, (path, start) in list(logs.items()):
            lines = lines_since(path, start)
            if any("task.stacks_dumped" in line for line in lines):
                stacks[name] = [
                    line for line in lines if "task.stack" in line or line.startswith(THREAD_LINES)
                ]
                del logs[name]
        time.sleep(0.2)
    for name, (path, start) in logs.items():  # the loop is blocked: its threads say where
        stacks[name] = ["(no answer to SIGUSR1)", *lines_since(path, start)[:60]]
    return stacks


def summary(stacks: dict[str, list[str]], path: Path) -> list[str]:
    """The stacks written whole to `path`; for a message, each service's tasks that wait in
    this project's code (not aiokafka's or uvicorn's own loops), with short paths, or its
    threads' stacks where its loop did not answer."""
    path.write_text("".join(f"## {name}\n" + "\n".join(ls) + "\n" for name, ls in stacks.items()))
    out = ["", f"Where each service's tasks wait (shared/stacks.py; all of it in {path}):"]
    for name, lines in stacks.items():
        out.append(f"{name}:")
        blocked = bool(lines) and lines[0].startswith("(no answer")
        for line in lines:
            task = re.search(r"task='([^']*)'", line)
            frames = re.search(r"frames='([^']*)'", line)
            if task and frames:
                if OWN_CODE.search(frames.group(1)):
                    out.append(f"  {task.group(1)}: {_short(frames.group(1))}")
            elif blocked or ("task.stack" not in line and not line.startswith(THREAD_LINES)):
                out.append(f"  {_short(line)}")
    return out


def _short(text: str) -> str:
    return LIBRARY_DIRS.sub("", text).replace(CHECKOUT, "")
