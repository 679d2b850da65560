"""`tokenbus up` as a user runs it: real broker and services, restarts, nothing left after."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import websockets

from shared.kafka import delete_topics, wait_for_broker
from shared.messages import Heartbeat
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tests.chat_client import run_requests
from tests.processes import cmdline, descendants, free_port_pair, running
from tests.stack import free_port, new_prefix, read_topic, wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
# The console script pyproject declares, from the environment running the tests.
TOKENBUS = Path(sys.executable).parent / "tokenbus"
SERVICES = {"ingest", "scheduler", "worker", "edge"}


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as reply:
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


def wait_ready(up: subprocess.Popen[bytes], port: int, log: Path) -> str:
    """Wait for `up` to announce its URLs, which it does once /readyz answers 200; return
    the development API key its banner prints."""
    announced = f"ws://127.0.0.1:{port}/v1/chat"
    wait_until(
        lambda: up.poll() is not None or announced in log.read_text(), 180, "tokenbus up ready"
    )
    assert up.poll() is None, f"tokenbus up exited with {up.returncode}:\n{log.read_text()}"
    assert healthy(port)
    assert f"http://127.0.0.1:{port}/" in log.read_text()
    key = re.search(r"^  API key +(\S+)$", log.read_text(), re.M)
    assert key is not None, f"no API key in the banner:\n{log.read_text()}"
    return key.group(1)


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


def chat_works(port: int, key: str, timeout_s: float = 180) -> None:
    """A chat request through the edge answered to its end (chat.done) before the deadline.

    A connection the edge closes or refuses (it is being restarted) is retried, as a client
    reconnects; so is a request answered `overloaded` (Kafka just came back), after its
    `retry_after_ms`.
    """

    async def chat() -> dict[str, Any] | None:
        async with websockets.connect(
            f"ws://127.0.0.1:{port}/v1/chat", additional_headers={"Authorization": f"Bearer {key}"}
        ) as ws:
            request = {"client_id": "c", "prompt": "still there?", "max_tokens": 4}
            transcripts = await run_requests(ws, [request], timeout=60)
        return transcripts["c"].final

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            final = asyncio.run(chat())
        except (websockets.ConnectionClosed, OSError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
            continue
        # `overloaded` while the edge has not yet seen Kafka back: try again as told.
        if final is None or final.get("code") != "overloaded" or time.monotonic() > deadline:
            break
        time.sleep((final.get("retry_after_ms") or 1000) / 1000)
    assert final is not None
    assert final["type"] == "chat.done", final


def restarted(up: subprocess.Popen[bytes], service: str, old_pid: int) -> int | None:
    """The pid of `service` under `up` once it is a new process, else None."""
    pid = service_pids(descendants(up.pid)).get(service)
    return pid if pid not in (None, old_pid) and running(pid) else None


def test_up_restarts_the_broker_it_started_and_sigterm_stops_everything(tmp_path: Path) -> None:
    state = tmp_path / "kafka"
    kafka_port, edge_port = free_port_pair(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.endswith("BOOTSTRAP_SERVERS")}
    env["TOKENBUS_KAFKA_STATE_DIR"] = str(state)
    env["TOKENBUS_EDGE_KEYS_FILE"] = str(tmp_path / "keys.json")  # a development key of its own
    log = tmp_path / "up.log"
    with tokenbus_up(log, env, "--port", str(edge_port), "--kafka-port", str(kafka_port)) as up:
        key = wait_ready(up, edge_port, log)
        tree = descendants(up.pid)
        broker = int((state / "kafka.pid").read_text())
        assert broker in tree, "up should run the broker it started as its own child"
        assert set(service_pids(tree)) == SERVICES

        os.kill(broker, signal.SIGKILL)
        wait_until(
            lambda: (
                f"Kafka (pid {broker}) exited with code -9 (SIGKILL); restarting in"
                in log.read_text()
            ),
            30,
            "up to report the broker's exit",
        )

        def new_broker() -> bool:
            # Read once: the launcher may remove the file between a check and a read.
            try:
                pid = int((state / "kafka.pid").read_text())
            except (FileNotFoundError, ValueError):
                return False
            return pid != broker

        wait_until(new_broker, 180, "a restarted broker")
        assert int((state / "kafka.pid").read_text()) in descendants(up.pid)
        chat_works(edge_port, key)
        assert up.poll() is None, log.read_text()

        tree = descendants(up.pid)
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=90) == 0, log.read_text()
        # `up` waits for every child before it exits; the deadline only covers stragglers
        # in a service's process group.
        wait_until(lambda: not any(running(pid) for pid in tree), 10, "every process of up to end")
        assert not (state / "kafka.pid").exists()


def test_a_killed_service_is_restarted_and_a_broker_up_did_not_start_is_spared(
    tmp_path: Path, bootstrap: str
) -> None:
    prefix, edge_port = new_prefix(), free_port()
    env = dict(
        os.environ,
        KAFKA_BOOTSTRAP_SERVERS=bootstrap,
        TOKENBUS_TOPIC_PREFIX=prefix,
        TOKENBUS_EDGE_KEYS_FILE=str(tmp_path / "keys.json"),
    )
    log = tmp_path / "up.log"
    try:
        with tokenbus_up(log, env, "--port", str(edge_port)) as up:
            key = wait_ready(up, edge_port, log)
            tree = descendants(up.pid)
            services = service_pids(tree)
            assert set(services) == SERVICES
            assert not any("kafka.Kafka" in cmdline(pid) for pid in tree)

            scheduler = services["scheduler"]
            os.kill(scheduler, signal.SIGKILL)
            wait_until(
                lambda: restarted(up, "scheduler", scheduler) is not None, 60, "a new scheduler"
            )
            said = f"scheduler (pid {scheduler}) exited with code -9 (SIGKILL); restarting in 1.0 s"
            assert said in log.read_text()
            chat_works(edge_port, key)
            assert up.poll() is None, log.read_text()

            tree = descendants(up.pid)
            up.send_signal(signal.SIGTERM)
            assert up.wait(timeout=90) == 0, log.read_text()
            wait_until(
                lambda: not any(running(pid) for pid in tree), 10, "every process of up to end"
            )
            # The broker `up` found running is still serving: `up` did not stop it.
            asyncio.run(wait_for_broker(settings(bootstrap, prefix), timeout_s=10))
    finally:
        asyncio.run(delete_topics(settings(bootstrap, prefix), Topics(prefix).partitions()))


def pool_pids(log: Path, key: str) -> list[int]:
    """The pids `up` started the service `key` as, in order (its restarts after the first)."""
    return [
        int(pid) for pid in re.findall(rf"started {re.escape(key)} \(pid (\d+)\)", log.read_text())
    ]


def live_workers_by_model(bootstrap: str, prefix: str, since: float) -> dict[str, set[str]]:
    """Model -> the ids of the workers that sent a heartbeat after `since` (Unix seconds)."""
    topic = Topics(prefix).workers
    partitions = Topics(prefix).partitions()[topic]
    values = asyncio.run(read_topic(settings(bootstrap, prefix), topic, partitions))
    out: dict[str, set[str]] = {}
    for value in values:
        beat = Heartbeat.model_validate_json(value)
        if beat.sent_at > since:
            out.setdefault(beat.model, set()).add(beat.worker_id)
    return out


def test_up_keeps_each_models_warm_pool_and_tells_every_service_the_models(
    tmp_path: Path, bootstrap: str
) -> None:
    prefix, edge_port = new_prefix(), free_port()
    env = dict(
        os.environ,
        KAFKA_BOOTSTRAP_SERVERS=bootstrap,
        TOKENBUS_TOPIC_PREFIX=prefix,
        TOKENBUS_EDGE_KEYS_FILE=str(tmp_path / "keys.json"),
    )
    log = tmp_path / "up.log"
    try:
        with tokenbus_up(log, env, "--port", str(edge_port), "--workers", "warm=2,cold=1") as up:
            key = wait_ready(up, edge_port, log)
            began = time.time()
            wait_until(
                lambda: (
                    {
                        m: len(ids)
                        for m, ids in live_workers_by_model(bootstrap, prefix, began).items()
                    }
                    == {"warm": 2, "cold": 1}
                ),
                60,
                "two workers of warm and one of cold beating",
            )
            (first,) = pool_pids(log, "worker-warm-1")
            os.kill(first, signal.SIGKILL)
            wait_until(lambda: len(pool_pids(log, "worker-warm-1")) == 2, 60, "worker-warm-1 again")
            killed_at = time.time() + 1.0  # the dead worker's last beat is older than this
            wait_until(
                lambda: (
                    len(live_workers_by_model(bootstrap, prefix, killed_at).get("warm", ())) == 2
                ),
                60,
                "the warm pool back at two workers",
            )
            # Every service is told the pools' models (held, not refused, while cold).
            for service, pid in service_pids(descendants(up.pid)).items():
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert b'TOKENBUS_SERVED_MODELS=["warm", "cold"]' in environ, service
            chat_works(edge_port, key)
            assert up.poll() is None, log.read_text()
    finally:
        asyncio.run(delete_topics(settings(bootstrap, prefix), Topics(prefix).partitions()))
