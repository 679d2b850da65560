"""The local Kafka launcher, run as users run it: start, status, start again, stop, conflicts.

One node and a three-node cluster; tests/test_cluster.py drives the cluster through clients."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import cmdline, free_port_pair, free_port_run, running

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent


def launcher(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.kafka.launcher", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip


def brokers_on(config: Path) -> list[int]:
    """Pids of the Kafka JVMs running with this config file."""
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and "kafka.Kafka" in (argv := cmdline(int(entry.name)))
        and str(config) in argv
    ]


def test_start_status_start_again_stop(tmp_path: Path) -> None:
    port = free_port_pair()
    state = tmp_path / "kafka"
    where = ("--port", str(port), "--state-dir", str(state))
    try:
        started = launcher("start", *where)
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"broker up at 127.0.0.1:{port}" in started.stdout
        pid = int((state / "kafka.pid").read_text())
        assert running(pid)
        assert "Kafka Server started" in (state / "server.log").read_text()

        # No --port: the launcher finds it from the state dir, as `tokenbus kafka` users expect.
        status = launcher("status", "--state-dir", str(state))
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"running at 127.0.0.1:{port} (pid {pid})" in status.stdout

        again = launcher("start", *where)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "already running" in again.stdout
        assert int((state / "kafka.pid").read_text()) == pid
        assert brokers_on(state / "server.properties") == [pid]

        stopped = launcher("stop", "--state-dir", str(state))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not running(pid)
        assert not (state / "kafka.pid").exists()

        after = launcher("status", *where)
        assert after.returncode == 1
        assert "not running" in after.stdout
        assert launcher("stop", *where).returncode == 0  # stopping nothing is fine
    finally:
        launcher("stop", "--state-dir", str(state))


def test_start_refuses_a_port_another_process_holds(tmp_path: Path) -> None:
    state = tmp_path / "kafka"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        result = launcher("start", "--port", str(port), "--state-dir", str(state))
    assert result.returncode == 1
    assert f"port 127.0.0.1:{port} is in use by another process" in result.stderr
    assert not (state / "kafka.pid").exists()


def test_three_node_cluster_start_status_start_again_stop(tmp_path: Path) -> None:
    port = free_port_run(6)
    state = tmp_path / "kafka"
    bootstrap = f"127.0.0.1:{port},127.0.0.1:{port + 2},127.0.0.1:{port + 4}"
    try:
        started = launcher("start", "--nodes", "3", "--port", str(port), "--state-dir", str(state))
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"3 of 3 nodes up at {bootstrap}" in started.stdout
        pids = [int((state / f"node-{i}" / "kafka.pid").read_text()) for i in (1, 2, 3)]
        assert all(running(pid) for pid in pids)
        for i, pid in enumerate(pids, start=1):
            assert brokers_on(state / f"node-{i}" / "server.properties") == [pid]
        config = (state / "node-2" / "server.properties").read_text()
        assert "node.id=2" in config
        assert (
            f"listeners=PLAINTEXT://127.0.0.1:{port + 2},CONTROLLER://127.0.0.1:{port + 3}"
            in config
        )
        voters = f"1@127.0.0.1:{port + 1},2@127.0.0.1:{port + 3},3@127.0.0.1:{port + 5}"
        assert f"controller.quorum.voters={voters}" in config

        # Neither --nodes nor --port: both come from the state dir.
        status = launcher("status", "--state-dir", str(state))
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"running at {bootstrap}" in status.stdout

        again = launcher("start", "--state-dir", str(state))
        assert again.returncode == 0, again.stdout + again.stderr
        assert "already running" in again.stdout
        assert [int((state / f"node-{i}" / "kafka.pid").read_text()) for i in (1, 2, 3)] == pids

        one = launcher("start", "--nodes", "1", "--state-dir", str(state))
        assert one.returncode == 1
        assert "holds a 3-node cluster" in one.stderr

        stopped = launcher("stop", "--state-dir", str(state))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not any(running(pid) for pid in pids)
        after = launcher("status", "--state-dir", str(state))
        assert after.returncode == 1
        assert "not running" in after.stdout
    finally:
        launcher("stop", "--state-dir", str(state))
