"""The local Kafka launcher, run as users run it: start, status, start again, stop, conflicts.

One node here (the session's faultable broker, which the launcher started), and what a
three-node cluster's nodes are told (a unit test). The CLI on a
running three-node cluster is tested on the session's cluster, which the launcher started
(tests/test_cluster.py: status, start again, a conflicting `--nodes`), with no cluster of
its own (issue 36)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.kafka import launcher as launcher_module
from deploy.kafka.launcher import Cluster, render_config
from tests.conftest import FaultableBroker
from tests.processes import cmdline, running
from tests.stack import wait_until

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


@pytest.mark.integration
def test_status_start_again_stop_and_start_on_a_running_node(
    faultable_broker: FaultableBroker,
) -> None:
    """On the session's faultable broker, a one-node cluster the launcher started (issue 36:
    no node of its own); whole again when the test ends, pass or fail (the fixture)."""
    state, port = faultable_broker.cluster.state_dir, faultable_broker.cluster.port
    where = ("--port", str(port), "--state-dir", str(state))
    pid = int((state / "kafka.pid").read_text())
    assert running(pid)

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

    started = launcher("start", *where)
    assert started.returncode == 0, started.stdout + started.stderr
    assert f"broker up at 127.0.0.1:{port}" in started.stdout
    restarted = int((state / "kafka.pid").read_text())
    assert restarted != pid
    assert running(restarted)
    assert brokers_on(state / "server.properties") == [restarted]
    assert "Kafka Server started" in (state / "server.log").read_text()


@pytest.mark.integration
def test_a_node_that_exited_unreaped_is_not_running() -> None:
    """A broker another process started (the faultable broker is this test process's child)
    is stopped once it exits, before its parent reaps it: `stop` from the CLI ends."""
    child = subprocess.Popen(["sleep", "0"])
    try:
        wait_until(lambda: launcher_module._zombie(child.pid), 10, "the child to exit")
        assert not launcher_module._alive(child.pid)
    finally:
        child.wait()
    assert not launcher_module._alive(child.pid)


@pytest.mark.integration
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


def test_a_three_node_clusters_nodes_listen_two_ports_apart_and_know_every_voter(
    tmp_path: Path,
) -> None:
    port = 41000
    cluster = Cluster.resolve(port, tmp_path / "kafka", nodes=3)
    assert cluster.bootstrap_servers == "127.0.0.1:41000,127.0.0.1:41002,127.0.0.1:41004"
    config = render_config(cluster, cluster.node(2))
    assert "node.id=2" in config.splitlines()
    assert "listeners=PLAINTEXT://127.0.0.1:41002,CONTROLLER://127.0.0.1:41003" in config
    assert "advertised.listeners=PLAINTEXT://127.0.0.1:41002" in config
    voters = "1@127.0.0.1:41001,2@127.0.0.1:41003,3@127.0.0.1:41005"
    assert f"controller.quorum.voters={voters}" in config.splitlines()
    assert f"log.dirs={cluster.node(2).data_dir}" in config.splitlines()
    assert "default.replication.factor=3" in config.splitlines()
