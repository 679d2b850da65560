"""The Go-built tools some tests run (kustomize, etcd, kube-apiserver, promtool, Toxiproxy,
KEDA's CRDs): each waited for, or built, by `deploy/tools/build.sh --only NAME`.

`make test` starts `deploy/tools/build.sh` in the background when the cache lacks a tool and
runs the tests at once; a test that needs a tool still being built waits here for that build
(build.sh holds one lock per tool), and one run without `make test` builds it. A cold
kube-apiserver is 10+ minutes: a module that waits carries `WAITS_FOR_BUILD` and waits in a
fixture, so pytest-timeout times its tests and `WAIT_S` bounds the wait.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "deploy" / "tools" / "build.sh"
# Where deploy/test.sh's background build writes (what a waiting test is waiting on).
BACKGROUND_LOG = ROOT / ".tokenbus" / "tools-build.out"
# The longest wait for one tool: a cold kube-apiserver on 2 busy cores, with etcd before it.
WAIT_S = 3600.0
# pytest-timeout times fixtures too unless `func_only`: with this mark the tests keep the
# suite's limit while their fixtures wait (bounded by WAIT_S) for a tool's build.
WAITS_FOR_BUILD = pytest.mark.timeout(func_only=True)


class ToolNotBuilt(RuntimeError):
    """build.sh could neither find nor build the tool; the message says why."""


_found: dict[str, Path] = {}
_failed: dict[str, ToolNotBuilt] = {}


def built(name: str) -> Path:
    """The path of tool `name`, waiting for (or doing) its build; one try per session."""
    if name in _found:
        return _found[name]
    if name in _failed:
        raise _failed[name]
    try:
        _found[name] = _wait_for(name)
    except ToolNotBuilt as exc:
        _failed[name] = exc
        raise
    return _found[name]


def _wait_for(name: str) -> Path:
    print(
        f"built_tools: waiting for {name}: {BUILD.relative_to(ROOT)} --only {name} "
        f"(make test's background build logs to {BACKGROUND_LOG.relative_to(ROOT)})",
        file=sys.stderr,
    )
    # Its own session: on a timeout or an interrupt its whole build (go and its compilers) ends.
    process = subprocess.Popen(
        [str(BUILD), "--only", name],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        _end(process)
        raise ToolNotBuilt(
            f"{name} was not built within {WAIT_S:.0f} s of waiting for "
            f"`deploy/tools/build.sh --only {name}`; see {BACKGROUND_LOG}"
        ) from None
    except BaseException:
        _end(process)
        raise
    sys.stderr.write(err)
    path = Path(out.strip().splitlines()[-1]) if out.strip() else None
    if process.returncode != 0 or path is None or not path.exists():
        raise ToolNotBuilt(
            f"{name} is not built: `deploy/tools/build.sh --only {name}` exited "
            f"{process.returncode}: {err.strip()[-3000:]}"
        )
    return path


def _end(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
        os.killpg(process.pid, signal.SIGTERM)
    process.communicate()
