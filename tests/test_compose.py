"""docker-compose.yml and the images: what `docker compose config` resolves, per profile."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from services.worker.settings import WorkerSettings
from tests.tools import compose_cli

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
PYTHON_SERVICES = {"edge", "ingest", "scheduler", "worker", "topics"}
# Where each service's healthcheck probes /healthz (the edge: its public port, as a load
# balancer does), and where each serves /metrics (the edge: its own port, never 8000).
HEALTH_PORTS = {"edge": 8000, "ingest": 9101, "scheduler": 9102, "worker": 9103}
METRICS_PORTS = {"edge": 9100, "ingest": 9101, "scheduler": 9102, "worker": 9103}
ENV = {"TOKENBUS_RESUME_SECRET": "s" * 44, "PATH": "/usr/bin:/bin"}


def config(
    *profiles: str, files: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> dict[str, Any]:
    """The compose model as Compose resolves it (profiles from .env unless given); `files`:
    compose files layered in order (default: docker-compose.yml alone); `env`: more
    variables."""
    args = [str(compose_cli())]
    for f in files:
        args += ["-f", f]
    for p in profiles:
        args += ["--profile", p]
    out = subprocess.run(
        [*args, "config", "--format", "json"],
        cwd=ROOT,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    model: dict[str, Any] = json.loads(out.stdout)
    return model


def seconds(duration: str) -> float:
    """Compose durations as `config` prints them ("30s", "1m30s")."""
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([hms])", duration))


@pytest.fixture(scope="module")
def default() -> dict[str, Any]:
    return config()


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    return config("gpu")


def test_profiles_pick_one_worker(default: dict[str, Any], gpu: dict[str, Any]) -> None:
    common = {"kafka", "jaeger", "topics", "edge", "ingest", "scheduler", "prometheus", "grafana"}
    assert set(default["services"]) == common | {"worker"}
    assert set(gpu["services"]) == common | {"worker-vllm"}


def test_config_fails_without_the_resume_secret() -> None:
    out = subprocess.run(
        [str(compose_cli()), "config", "-q"],
        cwd=ROOT,
        env={"PATH": ENV["PATH"]},
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode != 0
    assert "set a 32+ byte secret" in out.stderr


def test_kafka_has_a_host_listener(default: dict[str, Any]) -> None:
    kafka = default["services"]["kafka"]
    advertised = kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert "HOST://127.0.0.1:9092" in advertised
    assert {"target": 9092, "published": "9092"}.items() <= kafka["ports"][0].items()
    internal = next(a for a in advertised if a.startswith("INTERNAL://"))
    bootstrap = default["services"]["edge"]["environment"]["KAFKA_BOOTSTRAP_SERVERS"]
    assert internal == f"INTERNAL://{bootstrap}"


def test_workers_outlast_their_drain(default: dict[str, Any], gpu: dict[str, Any]) -> None:
    for model, name in ((default, "worker"), (gpu, "worker-vllm")):
        worker = model["services"][name]
        drain = float(
            worker["environment"].get(
                "TOKENBUS_WORKER_DRAIN_TIMEOUT_S",
                WorkerSettings.model_fields["worker_drain_timeout_s"].default,
            )
        )
        grace = seconds(worker["stop_grace_period"])
        assert grace >= drain + 10, (name, grace, drain)  # room for the hand-back writes


def test_every_service_has_a_healthcheck_on_healthz(
    default: dict[str, Any], gpu: dict[str, Any]
) -> None:
    services = {**default["services"], **gpu["services"]}
    for name, service in services.items():
        if name == "topics":  # a job: done is its health (the others wait for it)
            assert service.get("healthcheck") is None
            continue
        test = " ".join(service["healthcheck"]["test"])
        port = HEALTH_PORTS.get(name.removesuffix("-vllm"))
        if port is not None:
            assert f"http://127.0.0.1:{port}/healthz" in test, name


def test_metrics_are_reachable_on_every_service(
    default: dict[str, Any], gpu: dict[str, Any]
) -> None:
    services = {**default["services"], **gpu["services"]}
    for name, port in (*METRICS_PORTS.items(), ("worker-vllm", 9103)):
        service = services[name]
        (published,) = [p for p in service["ports"] if p["target"] == port]
        assert published["host_ip"] == "127.0.0.1", name
        assert service["environment"]["TOKENBUS_METRICS_HOST"] == "0.0.0.0", name


def test_python_services_share_one_image(default: dict[str, Any]) -> None:
    images = {default["services"][s]["image"] for s in PYTHON_SERVICES}
    assert images == {"tokenbus:dev"}
    builds = {default["services"][s]["build"]["dockerfile"] for s in PYTHON_SERVICES}
    assert builds == {"deploy/docker/Dockerfile"}


def test_images_run_as_a_user_and_vllm_is_pinned() -> None:
    for dockerfile in ("Dockerfile", "Dockerfile.vllm"):
        text = (ROOT / "deploy" / "docker" / dockerfile).read_text()
        users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
        assert users, dockerfile
        assert users[-1] not in ("root", "0"), dockerfile
    vllm = (ROOT / "deploy" / "docker" / "Dockerfile.vllm").read_text()
    [version] = re.findall(r"^ARG VLLM_VERSION=(v[\d.]+)$", vllm, re.MULTILINE)
    assert "FROM vllm/vllm-openai:${VLLM_VERSION}" in vllm
    assert f"vllm/vllm-openai:{version}" in (ROOT / "docs" / "engines.md").read_text()
    assert "-c /tmp/vllm-pins.txt" in vllm  # vLLM's own pins are held


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".tokenbus", ".env"} <= set(ignored)
