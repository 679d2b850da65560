"""`/healthz` and `/readyz` of every service (shared/health.py), on a real stack and alone."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest
import structlog
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError

from shared.health import (
    DEFAULT_PORTS,
    Readiness,
    consumer_readiness,
    health_port,
    with_health,
)
from shared.telemetry import TelemetrySettings
from tests.stack import Stack, free_port, wait_until


class FakeConsumer:
    """Fake of the two AIOKafkaConsumer calls readiness makes."""

    def __init__(self, assigned: set[TopicPartition], broker: str = "answers") -> None:
        self.assigned = assigned
        self.broker = broker  # answers | refuses | hangs

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    async def topics(self) -> set[str]:
        if self.broker == "refuses":
            raise KafkaConnectionError("connection refused")
        if self.broker == "hangs":
            await asyncio.sleep(60)
        return {tp.topic for tp in self.assigned}


def check(consumers: list[Any], timeout_s: float = 2.0) -> Readiness:
    return asyncio.run(consumer_readiness(consumers, timeout_s))


def test_readiness_needs_consumers_partitions_and_an_answering_broker() -> None:
    tp = TopicPartition("t.batches", 3)
    assert check([]).reason == "starting"
    assert check([None]).reason == "starting"
    assert check([FakeConsumer({tp}), None]).reason == "starting"
    assert check([FakeConsumer(set())]) == Readiness.not_ready("no partitions assigned")
    refused = check([FakeConsumer({tp}, "refuses")])
    assert (refused.ready, refused.reason) == (False, "kafka unreachable: KafkaConnectionError")
    hung = check([FakeConsumer({tp}, "hangs")], timeout_s=0.1)
    assert (hung.ready, hung.reason) == (False, "kafka unreachable: TimeoutError")
    ready = check([FakeConsumer({tp}), FakeConsumer({TopicPartition("t.control", 0)})])
    assert ready == Readiness(ready=True, reason="ok", partitions=["t.batches-3", "t.control-0"])


def test_metrics_port_is_on_by_default_with_a_port_per_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TOKENBUS_METRICS_PORT", raising=False)
    configured = TelemetrySettings().metrics_port
    ports = {s: health_port(s, configured) for s in ("edge", "ingest", "scheduler", "worker")}
    assert (
        ports == DEFAULT_PORTS == {"edge": 9100, "ingest": 9101, "scheduler": 9102, "worker": 9103}
    )
    assert health_port("worker", 0) == 0  # off
    monkeypatch.setenv("TOKENBUS_METRICS_PORT", "9555")
    assert health_port("worker", TelemetrySettings().metrics_port) == 9555


def _get(url: str) -> tuple[int, dict[str, Any]]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), json.loads(e.read())


def test_with_health_serves_beside_main_and_stops_with_it() -> None:
    port = free_port()
    seen: dict[str, tuple[int, dict[str, Any]]] = {}

    async def main() -> None:
        for path in ("/healthz", "/readyz"):
            seen[path] = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}{path}")

    async def not_ready() -> Readiness:
        return Readiness.not_ready("starting")

    asyncio.run(with_health(main(), service="worker", port=port, host="127.0.0.1", check=not_ready))
    assert seen["/healthz"] == (200, {"status": "alive"})
    assert seen["/readyz"] == (
        503,
        {"status": "not_ready", "ready": False, "reason": "starting", "partitions": []},
    )
    with pytest.raises(ConnectionRefusedError):  # the server is gone once main is over
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_port_in_use_is_logged_and_the_service_runs_without_health() -> None:
    ran: list[bool] = []

    async def main() -> None:
        ran.append(True)

    async def ready() -> Readiness:
        return Readiness(ready=True, reason="ok")

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with structlog.testing.capture_logs() as logs:
            asyncio.run(
                with_health(main(), service="ingest", port=port, host="127.0.0.1", check=ready)
            )
    assert ran == [True]
    assert [e["event"] for e in logs] == ["health.unavailable"]
    assert logs[0]["port"] == port


def test_every_service_is_alive_and_ready_with_its_partitions(stack: Stack) -> None:
    topics = stack.topics
    expected = {
        "ingest": topics.requests,
        "scheduler": topics.tiers[0],
        "worker": topics.batches,
    }
    for key in ("ingest", "scheduler", "worker", "edge"):
        assert stack.health(key, "/healthz") == (200, {"status": "alive"}), key
        wait_until(lambda k=key: stack.health(k, "/readyz")[0] == 200, 60, f"{key} /readyz")
        _, body = stack.health(key, "/readyz")
        assert (body["status"], body["reason"]) == ("ready", "ok"), (key, body)
        if key in expected:
            assert any(p.startswith(f"{expected[key]}-") for p in body["partitions"]), body
        # Served beside /healthz and /readyz on the metrics port; the edge answers those
        # two on its public port as well (stack.health), /metrics only on its metrics port.
        port = stack.health_ports[key]
        assert _get(f"http://127.0.0.1:{port}/healthz") == (200, {"status": "alive"}), key
        assert _get(f"http://127.0.0.1:{port}/readyz")[0] == 200, key
        metrics = stack.metrics(key)
        if key == "edge":  # its own registry: its metrics, no process collector
            assert "\ntokenbus_edge_streams_open " in metrics, metrics[:500]
        else:
            assert "\nprocess_cpu_seconds_total " in metrics, key
