"""deploy/tools/build.sh's locking and modes, with `go` faked: a second build.sh that needs a
tool another one is building waits for it and builds nothing; `--check` names what is
missing; `--only` refuses an unknown tool. The real builds are what the tests that run the
tools (tests/test_k8s*.py, tests/test_monitoring*.py, tests/chaos/) wait for."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import built_tools
from tests.built_tools import BUILD, ToolNotBuilt

pytestmark = pytest.mark.integration

TOOLS = ("toxiproxy", "keda-crds", "kustomize", "etcd", "kube-apiserver", "promtool")
# A fake `go build`: records its call, blocks until the test releases it (so the lock is
# held for as long as the test needs), then writes a stand-in binary where -o says, or fails.
FAKE_GO = """#!/usr/bin/env bash
echo "$*" >>"$FAKE_GO_CALLS"
while [ ! -e "$FAKE_GO_RELEASE" ]; do sleep 0.05; done
[ -z "${FAKE_GO_FAIL:-}" ] || { echo "fake go: build failed" >&2; exit 1; }
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
printf '#!/bin/sh\\necho fake\\n' >"$out" && chmod +x "$out"
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An empty tools cache and a fake `go` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "go").write_text(FAKE_GO)
    (bin_dir / "go").chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "TOKENBUS_TOOLS_DIR": str(tmp_path / "tools"),
        "FAKE_GO_CALLS": str(tmp_path / "go-calls"),
        "FAKE_GO_RELEASE": str(tmp_path / "release"),
    }


@pytest.fixture
def session_env(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """`env` as this process's environment, and built_tools' memory of this session emptied
    (the real tools may have been found, or failed, by an earlier test)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(built_tools, "_found", {})
    monkeypatch.setattr(built_tools, "_failed", {})
    return env


def build(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BUILD), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def poll(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def calls(env: dict[str, str]) -> list[str]:
    path = Path(env["FAKE_GO_CALLS"])
    return path.read_text().splitlines() if path.exists() else []


def test_a_second_build_waits_for_the_first_and_builds_nothing(env: dict[str, str]) -> None:
    first = build(env, "--only", "kustomize")
    poll(lambda: len(calls(env)) == 1, "the first build.sh to start go build")
    second = build(env, "--only", "kustomize")
    assert second.stderr is not None
    waiting = second.stderr.readline()
    assert "waiting for the kustomize build that another build.sh is running" in waiting
    assert second.poll() is None, "the second returned while the first held the lock"

    Path(env["FAKE_GO_RELEASE"]).touch()
    out1, err1 = first.communicate(timeout=30)
    out2, err2 = second.communicate(timeout=30)

    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    assert out1 == out2
    path = Path(out1.strip())
    assert path.name == "kustomize"
    assert os.access(path, os.X_OK)
    assert path.is_relative_to(env["TOKENBUS_TOOLS_DIR"])
    assert len(calls(env)) == 1, calls(env)
    assert "building kustomize" in err1
    assert "built in" in err1
    assert "building" not in err2


def test_check_names_every_missing_tool_and_builds_nothing(env: dict[str, str]) -> None:
    done = subprocess.run(
        [str(BUILD), "--check"], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert f"not built yet: {' '.join(TOOLS)}" in done.stderr
    assert calls(env) == []


def test_check_lists_what_is_built(env: dict[str, str]) -> None:
    Path(env["FAKE_GO_RELEASE"]).touch()
    built = subprocess.run(
        [str(BUILD), "--only", "etcd"], env=env, capture_output=True, text=True, timeout=30
    )
    assert built.returncode == 0, built.stderr

    done = subprocess.run(
        [str(BUILD), "--check"], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1
    assert done.stdout == f"etcd {built.stdout.strip()}\n"
    assert "not built yet: toxiproxy keda-crds kustomize kube-apiserver promtool" in done.stderr


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--only", "kubectl"], f"no tool named kubectl; the tools: {' '.join(TOOLS)}"),
        (["--only"], "--only needs a tool's name"),
        (["--all"], "unknown argument: --all"),
    ],
)
def test_bad_arguments_are_refused(env: dict[str, str], args: list[str], error: str) -> None:
    done = subprocess.run([str(BUILD), *args], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert error in done.stderr
    assert calls(env) == []


def test_built_waits_for_the_build_under_way(session_env: dict[str, str]) -> None:
    env = session_env
    holder = build(env, "--only", "promtool")
    poll(lambda: len(calls(env)) == 1, "the holder to start go build")

    waited: list[Path | BaseException] = []
    waiter = threading.Thread(target=_record, args=(waited, "promtool"))
    waiter.start()
    lock = Path(env["TOKENBUS_TOOLS_DIR"]) / "promtool" / ".lock"
    poll(lambda: _blocked_on(lock), "built() to wait on promtool's lock")
    assert not waited
    Path(env["FAKE_GO_RELEASE"]).touch()
    out, err = holder.communicate(timeout=30)
    waiter.join(timeout=30)

    assert holder.returncode == 0, err
    assert waited == [Path(out.strip())]
    assert len(calls(env)) == 1


def _record(into: list[Path | BaseException], name: str) -> None:
    try:
        into.append(built_tools.built(name))
    except BaseException as exc:  # the test asserts on it
        into.append(exc)


def _blocked_on(lock: Path) -> bool:
    """Whether a process waits for a flock on `lock` (a `->` line of /proc/locks)."""
    if not lock.exists():
        return False
    inode = f":{lock.stat().st_ino} "
    return any(
        "->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines()
    )


def test_built_raises_a_clear_error_once_when_the_build_fails(
    session_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = session_env
    monkeypatch.setenv("FAKE_GO_FAIL", "1")
    Path(env["FAKE_GO_RELEASE"]).touch()

    with pytest.raises(ToolNotBuilt, match="fake go: build failed") as caught:
        built_tools.built("kustomize")
    assert "could not build: kustomize" in str(caught.value)
    with pytest.raises(ToolNotBuilt):
        built_tools.built("kustomize")
    assert len(calls(env)) == 1, "a failed tool is tried once per session"
