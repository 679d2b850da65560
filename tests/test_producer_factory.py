"""Every Kafka producer comes from shared/kafka.py, which sets acks=all and idempotence.

The source tree is read (ast), not imported: a producer built anywhere else fails this test
with its file and line, whether it is written `AIOKafkaProducer(...)`, through an alias
(`from aiokafka import AIOKafkaProducer as P`) or as `aiokafka.AIOKafkaProducer(...)`.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

from aiokafka import AIOKafkaProducer

from shared.kafka import make_consumer, make_producer
from shared.settings import TokenbusSettings

ROOT = Path(__file__).resolve().parent.parent
FACTORY = "shared/kafka.py"
# Classes that build a producer: aiokafka's, FastStream's broker (it owns one; FastStream is
# no dependency since ADR 0052, so one built anywhere is refused here too), kafka-python's
# and confluent-kafka's, and aiokafka's low-level client (a hand-rolled produce request).
PRODUCER_CLASSES = frozenset(
    {"AIOKafkaProducer", "KafkaBroker", "KafkaProducer", "AIOKafkaClient", "Producer"}
)
# Files that may build a raw producer, each with why: a test producer writing poison that a
# factory producer would refuse or that must not look like one of ours. Keep it short.
ALLOWED: dict[str, str] = {
    "tests/test_bad_input.py": "writes malformed records (poison) onto the requests topic, "
    "as an outside client would, to prove they reach the DLQ",
    "tests/test_poison_records.py": "writes poison (up to 4 MiB: past the factory's request "
    "size) onto every topic the scheduler and worker read, as a broken producer would",
}
SKIPPED_DIRS = frozenset({"__pycache__", "node_modules", "build", "dist"})


def python_files() -> Iterator[Path]:
    for directory, subdirs, files in os.walk(ROOT):
        # Hidden folders hold the virtualenv, git and state, not the project's source.
        subdirs[:] = [d for d in subdirs if not d.startswith(".") and d not in SKIPPED_DIRS]
        for name in files:
            if name.endswith(".py"):
                yield Path(directory, name)


def producer_calls(source: str) -> list[tuple[int, str]]:
    """(line, class) of every call that constructs a producer class in `source`."""
    tree = ast.parse(source)
    names = {name: name for name in PRODUCER_CLASSES}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in PRODUCER_CLASSES:
                    names[alias.asname or alias.name] = alias.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else None
        if isinstance(func, ast.Attribute):
            called = func.attr
        if called in names:
            found.append((node.lineno, names[called]))
    return sorted(found)


def test_no_producer_is_built_outside_the_factory() -> None:
    offenders = []
    scanned = 0
    for path in python_files():
        relative = path.relative_to(ROOT).as_posix()
        scanned += 1
        if relative == FACTORY or relative in ALLOWED:
            continue
        for line, cls in producer_calls(path.read_text()):
            offenders.append(f"{relative}:{line}: {cls}(…) outside {FACTORY}")
    assert scanned > 50, f"only {scanned} Python files found under {ROOT}"
    assert not offenders, (
        "build producers with shared.kafka.make_producer (acks=all, idempotent):\n"
        + "\n".join(offenders)
    )


def test_the_factory_itself_builds_producers() -> None:
    # The scan would pass vacuously if it could not see a producer being built.
    calls = {cls for _, cls in producer_calls((ROOT / FACTORY).read_text())}
    assert "AIOKafkaProducer" in calls


def test_the_scan_sees_aliases_and_attributes() -> None:
    source = (
        "from aiokafka import AIOKafkaProducer as P\n"
        "import faststream.kafka\n"
        "p = P(bootstrap_servers='x')\n"
        "b = faststream.kafka.KafkaBroker('x')\n"
        "c = AIOKafkaConsumer('t')\n"
    )
    assert producer_calls(source) == [(3, "AIOKafkaProducer"), (4, "KafkaBroker")]


def test_every_allowed_file_still_builds_a_producer() -> None:
    # A stale entry would silently allow a producer added to that file later.
    for relative in ALLOWED:
        assert producer_calls((ROOT / relative).read_text()), f"{relative} needs no entry"


def acks_all_and_idempotent(producer: AIOKafkaProducer) -> bool:
    # aiokafka keeps both private: acks=all is -1 on the sender; idempotence (or a
    # transactional id) is what gives the producer a transaction manager.
    return bool(producer._sender._acks == -1 and producer._txn_manager is not None)


async def test_make_producer_is_acks_all_and_idempotent(bootstrap: str) -> None:
    # Every server of a comma-separated list counts: the first one here answers nothing.
    settings = TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:1,{bootstrap}")
    producer = make_producer(settings, client_id="factory-test")
    try:
        await producer.start()  # through the second server
        assert acks_all_and_idempotent(producer)
    finally:
        await producer.stop()


async def test_the_client_timeouts_reach_aiokafka() -> None:
    """TOKENBUS_KAFKA_PRODUCER_REQUEST_TIMEOUT_MS and TOKENBUS_KAFKA_SESSION_TIMEOUT_MS (the
    fault tests set them short, ADR 0065) are what the factories' clients run with; a
    producer given its own bound keeps it."""
    settings = TokenbusSettings(
        kafka_producer_request_timeout_ms=4000, kafka_session_timeout_ms=6000
    )
    producer = make_producer(settings, client_id="t")
    own = make_producer(settings, client_id="t", request_timeout_ms=3000)
    consumer = make_consumer(settings, "t.topic", group_id="g", client_id="t")
    try:
        assert producer.client._request_timeout_ms == 4000
        assert own.client._request_timeout_ms == 3000
        assert consumer._session_timeout_ms == 6000
        assert consumer._heartbeat_interval_ms == 1800
    finally:  # never started: closed all the same, as aiokafka warns otherwise
        await producer.stop()
        await own.stop()
        await consumer.stop()
