"""What docker compose publishes: loopback only, unless Kafka's secured listener is chosen.

Checked with the real Compose v2 CLI (`docker compose config`, tests/test_compose.py), every
profile. The attacker is anyone on the network of a machine that ran `docker compose up`:
before, Kafka's PLAINTEXT, unauthenticated listener (`"9092:9092"`), Jaeger's UI and OTLP
ports and the edge were published on every interface.
"""

from __future__ import annotations

import ipaddress
import subprocess
from typing import Any

import pytest

from tests.test_compose import ENV, ROOT, config
from tests.tools import compose_cli

pytestmark = pytest.mark.integration

EXPOSED = ("docker-compose.yml", "docker-compose.exposed.yml")
EXPOSED_ENV = {
    "TOKENBUS_APPS": "app,app2",
    "KAFKA_EXTERNAL_ADVERTISED": "kafka.example.com",
    "TOKENBUS_KAFKA_TLS_DIR": "/etc/tokenbus/kafka-tls",
    "TOKENBUS_KAFKA_USERS_DIR": "/etc/tokenbus/kafka-users",
}


def published(model: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(service, host address, container port) of every published port."""
    return [
        (name, port.get("host_ip") or "0.0.0.0", int(port["target"]))
        for name, service in model["services"].items()
        for port in service.get("ports", [])
    ]


def loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


@pytest.mark.parametrize("profile", ["sim", "gpu"])
def test_every_port_of_every_profile_is_on_loopback(profile: str) -> None:
    ports = published(config(profile))
    assert ports  # the check saw the ports at all
    exposed = [p for p in ports if not loopback(p[1])]
    assert not exposed, f"published beyond 127.0.0.1: {exposed}"


def kafka_listener_of(kafka: dict[str, Any], port: int) -> tuple[str, str]:
    """(listener name, security protocol) of the listener on container port `port`."""
    env = kafka["environment"]
    names = {
        int(address.rsplit(":", 1)[1]): address.split("://")[0]
        for address in env["KAFKA_LISTENERS"].split(",")
    }
    protocols = dict(p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    return names[port], protocols[names[port]]


@pytest.mark.parametrize("profile", ["sim", "gpu"])
def test_the_exposed_file_adds_only_kafkas_sasl_ssl_listener_with_acls(profile: str) -> None:
    model = config(profile, files=EXPOSED, env=EXPOSED_ENV)
    exposed = [p for p in published(model) if not loopback(p[1])]
    assert [(s, port) for s, _, port in exposed] == [("kafka", 9094)]
    kafka = model["services"]["kafka"]
    assert kafka_listener_of(kafka, 9094) == ("EXTERNAL", "SASL_SSL")
    env = kafka["environment"]
    assert env["KAFKA_LISTENER_NAME_EXTERNAL_SSL_CLIENT_AUTH"] == "required"
    assert env["KAFKA_AUTHORIZER_CLASS_NAME"].endswith("StandardAuthorizer")
    assert env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    # The PLAINTEXT host listener stays on loopback.
    assert kafka_listener_of(kafka, 9092) == ("HOST", "PLAINTEXT")
    assert ("kafka", "127.0.0.1", 9092) in published(model)
    # Each application gets its own topics and grants, and ingest reads them.
    assert "--acls" in " ".join(model["services"]["topics"]["command"])
    assert model["services"]["ingest"]["environment"]["TOKENBUS_INGEST_APPS"] == "app,app2"


def test_the_exposed_file_refuses_to_start_half_configured() -> None:
    args = [str(compose_cli()), "-f", EXPOSED[0], "-f", EXPOSED[1], "config", "-q"]
    out = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, check=False)
    assert out.returncode != 0
    assert "set the" in out.stderr
