"""`tokenbus up` as a user runs it: real broker, real services, and nothing left after a stop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared.kafka import delete_topics, wait_for_broker
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tests.processes import cmdline, descendants, free_port_pair, running
from tests.stack import free_port, new_prefix, wait_until

ROOT = Path(__file__).resolve().parent.parent
# The console script pyproject declares, from the environment running the tests.
TOKENBUS = Path(sys.executable).parent / "tokenbus"
SERVICES = {"ingest", "scheduler", "worker", "edge"}


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@contextmanager
def tokenbus_up(log: Path, env: dict[str, str], *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """Run `tokenbus up`; whatever the test asserts, no process of it outlives the test."""
    with open(log, "wb") as out:
        up = subprocess.Popen(
            [str(TOKENBUS), "up", *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield up
    finally:
        # Collected before `up` is killed: its children then stop being its descendants.
        left = descendants(up.pid)
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid in left:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def wait_ready(up: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Wait for `up` to announce its URLs, which it does once /healthz answers 200."""
    announced = f"ws://127.0.0.1:{port}/v1/chat"
    wait_until(
        lambda: up.poll() is not None or announced in log.read_text(), 180, "tokenbus up ready"
    )
    assert up.poll() is None, f"tokenbus up exited with {up.returncode}:\n{log.read_text()}"
    assert healthy(port)
    assert f"http://127.0.0.1:{port}/" in log.read_text()


def settings(bootstrap: str, prefix: str) -> TokenbusSettings:
    return TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap, topic_prefix=prefix)


def service_pids(pids: set[int]) -> dict[str, int]:
    """Service name -> pid, for the processes run as `python -m services.<name>`."""
    found: dict[str, int] = {}
    for pid in pids:
        argv = cmdline(pid)
        if "-m" in argv and argv.index("-m") + 1 < len(argv):
            module = argv[argv.index("-m") + 1]
            if module.startswith("services."):
                found[module.removeprefix("services.")] = pid
    return found


def test_up_serves_and_sigterm_stops_services_and_its_broker(tmp_path: Path) -> None:
    state = tmp_path / "kafka"
    kafka_port, edge_port = free_port_pair(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.endswith("BOOTSTRAP_SERVERS")}
    env["TOKENBUS_KAFKA_STATE_DIR"] = str(state)
    log = tmp_path / "up.log"
    with tokenbus_up(log, env, "--port", str(edge_port), "--kafka-port", str(kafka_port)) as up:
        wait_ready(up, edge_port, log)
        tree = descendants(up.pid)
        broker = int((state / "kafka.pid").read_text())
        assert broker in tree, "up should run the broker it started as its own child"
        assert set(service_pids(tree)) == SERVICES

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=90) == 0, log.read_text()
        # `up` waits for every child before it exits; the deadline only covers stragglers
        # in a service's process group.
        wait_until(lambda: not any(running(pid) for pid in tree), 10, "every process of up to end")
        assert not (state / "kafka.pid").exists()


def test_a_dying_service_stops_up_with_an_error_and_spares_a_broker_it_did_not_start(
    tmp_path: Path, bootstrap: str
) -> None:
    prefix, edge_port = new_prefix(), free_port()
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=bootstrap, TOKENBUS_TOPIC_PREFIX=prefix)
    log = tmp_path / "up.log"
    try:
        with tokenbus_up(log, env, "--port", str(edge_port)) as up:
            wait_ready(up, edge_port, log)
            tree = descendants(up.pid)
            services = service_pids(tree)
            assert set(services) == SERVICES
            assert not any("kafka.Kafka" in cmdline(pid) for pid in tree)

            os.kill(services["scheduler"], signal.SIGKILL)
            assert up.wait(timeout=60) == 1, log.read_text()
            assert "service scheduler" in log.read_text()
            wait_until(
                lambda: not any(running(pid) for pid in tree), 10, "every process of up to end"
            )
            # The broker `up` found running is still serving: `up` did not stop it.
            asyncio.run(wait_for_broker(settings(bootstrap, prefix), timeout_s=10))
    finally:
        asyncio.run(delete_topics(settings(bootstrap, prefix), Topics(prefix).partitions()))
