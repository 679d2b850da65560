"""`tokenbus up` as a user runs it: real broker and services, restarts, nothing left after."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import websockets

from shared.kafka import delete_topics, wait_for_broker
from shared.messages import Heartbeat
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tests.chat_client import ChatSession, run_requests
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


def incarnations(bootstrap: str, prefix: str, since: float) -> dict[str, set[float]]:
    """Worker id -> the process starts (`started_at`) its heartbeats after `since` name."""
    topic = Topics(prefix).workers
    partitions = Topics(prefix).partitions()[topic]
    values = asyncio.run(read_topic(settings(bootstrap, prefix), topic, partitions))
    out: dict[str, set[float]] = {}
    for value in values:
        beat = Heartbeat.model_validate_json(value)
        if beat.sent_at > since:
            out.setdefault(beat.worker_id, set()).add(beat.started_at)
    return out


async def ask_all(
    port: int,
    key: str,
    count: int,
    tag: str,
    max_tokens: int = 8,
    midway: Callable[[], None] | None = None,
) -> list[str]:
    """`count` requests for the pool's model at once, `midway()` called once the first
    answer streams; the final frame type of each, checked to be its one final."""
    async with websockets.connect(
        f"ws://127.0.0.1:{port}/v1/chat", additional_headers={"Authorization": f"Bearer {key}"}
    ) as ws:
        session = ChatSession(ws)
        for i in range(count):
            prompt = f"{tag} {i}"
            await session.send(
                {"client_id": prompt, "prompt": prompt, "model": "warm", "max_tokens": max_tokens}
            )
        if midway is not None:
            await session.until(
                lambda: any(t.deltas for t in session.by_client.values()), within=60
            )
            await asyncio.to_thread(midway)
        await session.until(session.all_ended, within=120)
    out: list[str] = []
    for t in session.by_client.values():  # one final each: nothing answered twice
        assert sum(f["type"] in ("chat.done", "error") for f in t.frames) == 1, t.frames
        assert t.final is not None
        out.append(t.final["type"])
    return out


IDLE_S = 5.0  # traffic gone for longer than a worker's heartbeats take to count it dead


def test_a_warm_pool_keeps_its_minimum_loaded_through_a_scale_down(
    tmp_path: Path, bootstrap: str
) -> None:
    """Issue 28, point 6: load comes and goes, and the pool stays at its minimum, loaded.

    When the traffic stops, both workers of `warm=2` stay up and loaded: the same processes,
    the same incarnations, serving the next request without a start. When one is stopped as
    a scale-down stops a pod (SIGTERM: it drains) while requests run, every request ends
    once, `up` starts it again (the pool's minimum), and the other never restarted.
    """
    prefix, edge_port = new_prefix(), free_port()
    env = dict(
        os.environ,
        KAFKA_BOOTSTRAP_SERVERS=bootstrap,
        TOKENBUS_TOPIC_PREFIX=prefix,
        TOKENBUS_EDGE_KEYS_FILE=str(tmp_path / "keys.json"),
    )
    log = tmp_path / "up.log"

    def pool_since(since: float) -> dict[str, set[float]]:
        """The pool's workers beating after `since`: worker id (host-pid) -> incarnations."""
        return incarnations(bootstrap, prefix, since)

    try:
        with tokenbus_up(log, env, "--port", str(edge_port), "--workers", "warm=2") as up:
            key = wait_ready(up, edge_port, log)
            began = time.time()
            wait_until(lambda: len(pool_since(began)) == 2, 60, "both workers beating")
            # 1) Load, then none: the pool idles at its minimum, loaded.
            assert asyncio.run(ask_all(edge_port, key, 16, "busy")) == ["chat.done"] * 16
            loaded = pool_since(began)
            assert all(len(starts) == 1 for starts in loaded.values()), loaded
            idle_from = time.time()
            wait_until(
                lambda: set(pool_since(idle_from + IDLE_S)) == set(loaded),
                IDLE_S + 30,
                f"both workers still beating after {IDLE_S} s without traffic",
            )
            assert pool_since(idle_from) == loaded  # the same processes, never restarted
            assert [len(pool_pids(log, f"worker-warm-{i}")) for i in (1, 2)] == [1, 1]
            assert asyncio.run(ask_all(edge_port, key, 2, "after-idle")) == ["chat.done"] * 2
            assert pool_since(idle_from) == loaded

            # 2) A scale-down stops one worker mid-load: it drains, every request ends once,
            # and the pool is back at its minimum.
            (victim,) = pool_pids(log, "worker-warm-2")
            victim_id = next(w for w in loaded if w.endswith(f"-{victim}"))
            stop = functools.partial(os.kill, victim, signal.SIGTERM)
            drained = ask_all(edge_port, key, 12, "drain", max_tokens=40, midway=stop)
            assert asyncio.run(drained) == ["chat.done"] * 12
            wait_until(lambda: len(pool_pids(log, "worker-warm-2")) == 2, 60, "warm-2 again")
            assert f"worker-warm-2 (pid {victim}) exited with code 0" in log.read_text()
            restarted_at = time.time()
            wait_until(lambda: len(pool_since(restarted_at)) == 2, 60, "the pool back at two")
            after = pool_since(restarted_at)
            (survivor,) = set(loaded) - {victim_id}
            assert after[survivor] == loaded[survivor]  # never restarted
            assert victim_id not in after  # its replacement is a new process
            assert len(pool_pids(log, "worker-warm-1")) == 1
            assert up.poll() is None, log.read_text()
    finally:
        asyncio.run(delete_topics(settings(bootstrap, prefix), Topics(prefix).partitions()))
