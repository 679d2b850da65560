"""The edge's /metrics is not on its public port (issue 24, finding "/metrics on the edge's
public port").

The attacker is anyone who reaches the edge's public port (the one port meant for clients:
the chat page, the WebSocket, the OpenAI-compatible API), with no key or with a tenant's
key, asking for `/metrics` as a scraper would. On main (39c476a) the edge answered it with
its whole Prometheus registry, no key asked: streams open, requests and tokens per tier,
errors by code, result-topic churn, latency histograms; what the load is and how it is
served. Now the public app has no such route (404), and the registry is served on the
metrics port (`TOKENBUS_METRICS_PORT`, 9100 by default), bound to `TOKENBUS_METRICS_HOST`
(127.0.0.1 by default) as ingest's, the scheduler's and the worker's are.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST

from shared.telemetry import TelemetrySettings
from tests.stack import Stack

# What only the edge's registry holds: any of these in an answer is the leak.
EDGE_SERIES = ("tokenbus_edge_", "tokenbus_genai_", "# TYPE ")
TCP_LISTEN = "0A"  # the state column of /proc/net/tcp{,6}


@pytest.fixture(scope="module")
def stack(stack: Stack) -> Stack:
    """The session's default stack (tests/conftest.py)."""
    # The bind address under test is the default one, not one this shell chose.
    assert "TOKENBUS_METRICS_HOST" not in stack.env(), "unset TOKENBUS_METRICS_HOST to run this"
    return stack


def leaks(body: str) -> list[str]:
    return [series for series in EDGE_SERIES if series in body]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/metrics"),
        ("HEAD", "/metrics"),
        ("GET", "/metrics/"),  # on main: a redirect to /metrics, followed
        ("GET", "/metrics?name[]=tokenbus_edge_streams_open"),
    ],
)
@pytest.mark.parametrize("tenant", [None, "mallory"])
def test_the_public_port_has_no_metrics(
    stack: Stack, method: str, path: str, tenant: str | None
) -> None:
    headers = {"Authorization": f"Bearer {stack.keys[tenant]}"} if tenant else {}
    with httpx.Client(base_url=stack.http_url, trust_env=False, follow_redirects=True) as client:
        answer = client.request(method, path, headers=headers, timeout=10)
    assert answer.status_code == 404, (answer.status_code, answer.text[:300])
    assert not leaks(answer.text), answer.text[:300]
    assert answer.headers.get("content-type") != CONTENT_TYPE_LATEST


def test_the_metrics_port_serves_the_edges_registry_and_its_probes(stack: Stack) -> None:
    metrics = stack.edge_metrics()
    assert "\ntokenbus_edge_streams_open " in metrics, metrics[:500]
    port = stack.health_ports["edge"]
    assert port != stack.edge_port
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False) as client:
        assert client.get("/metrics", timeout=10).headers["content-type"] == CONTENT_TYPE_LATEST
        for path in ("/healthz", "/readyz"):
            assert client.get(path, timeout=10).status_code == 200, path
        # Nothing of the public app is on the metrics port.
        assert client.get("/v1/models", timeout=10).status_code == 404


def listening_on(port: int) -> set[str]:
    """The addresses a TCP socket of this machine listens on at `port` (/proc/net/tcp{,6})."""
    addresses: set[str] = set()
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state != TCP_LISTEN or int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(address)
            # The kernel writes each 32-bit word in host (little-endian) order.
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            assert len(packed) == size
            addresses.add(str(ipaddress.ip_address(packed)))
    return addresses


def test_the_metrics_port_is_bound_to_loopback_by_default(stack: Stack) -> None:
    assert TelemetrySettings.model_fields["metrics_host"].default == "127.0.0.1"
    port = stack.health_ports["edge"]
    assert listening_on(port) == {"127.0.0.1"}
    # The public port, by contrast, is where the edge listens for everyone it serves.
    assert listening_on(stack.edge_port)
    # From another address of this machine (if it has one), nothing answers there.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:  # TEST-NET-1: the kernel picks the source address a packet would leave from
            probe.connect(("192.0.2.1", 9))  # (a UDP connect sends nothing)
            own = probe.getsockname()[0]
        except OSError:  # no route off this machine: loopback is all there is
            own = "127.0.0.1"
    if not ipaddress.ip_address(own).is_loopback:
        with pytest.raises(ConnectionRefusedError), socket.create_connection((own, port), 2):
            pass
