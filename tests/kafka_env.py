"""Finding a broker for the tests: KAFKA_BOOTSTRAP_SERVERS, else Docker, else a clear failure."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

NO_BROKER = (
    "No Kafka broker for the integration tests: set KAFKA_BOOTSTRAP_SERVERS to a running "
    "broker, run the tests with `make test` (it starts a local Apache Kafka on the JVM), or "
    "make a Docker engine reachable for testcontainers."
)


def _docker_reachable() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # any failure means: no usable engine
        return False


@contextmanager
def kafka_bootstrap() -> Iterator[str]:
    """Yield bootstrap servers of a real broker, or raise RuntimeError saying how to get one."""
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if given:
        yield given
        return
    if _docker_reachable():
        from testcontainers.kafka import KafkaContainer  # type: ignore[import-untyped]

        with KafkaContainer().with_kraft() as kafka:
            yield kafka.get_bootstrap_server()
        return
    raise RuntimeError(NO_BROKER)
