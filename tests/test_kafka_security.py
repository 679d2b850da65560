"""Kafka security: one set of settings for every client, least-privilege ACLs, a secured stack.

The integration tests run their own secured broker (`launcher --secure`: SASL_SSL with
SCRAM-SHA-512 and client certificates, the StandardAuthorizer, nothing allowed without an
ACL) on free ports in a temp dir; every service logs in as its own principal.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from aiokafka import TopicPartition
from aiokafka.errors import TopicAuthorizationFailedError
from pydantic import ValidationError

from deploy.kafka import launcher
from deploy.kafka import secure as secured
from services.ingest.memory import Memory, RecallRefused, recall
from services.worker.engines.sim_text import complete
from shared.kafka import (
    KafkaLoginRefused,
    client_security,
    create_topics,
    make_admin,
    make_consumer,
    make_producer,
    wait_for_broker,
)
from shared.messages import Tier
from shared.process import new_service_loop
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tests.chat_client import run_requests
from tests.stack import ROOT, Stack, new_prefix, settings_from_env, wait_until
from tests.test_chat_e2e import check_transcript, make_request
from tests.test_external_producer import kcat
from tests.test_producer_factory import ROOT as SOURCE_ROOT
from tests.test_producer_factory import python_files
from tests.worker_logs import events
from tokenbus.acls import (
    ROLES,
    Acl,
    Operation,
    Pattern,
    Permission,
    Resource,
    app_acls,
    create_acls,
    parse_principals,
    reply_prefix,
    service_acls,
)

pytestmark = pytest.mark.integration

# -- client settings (no broker) ----------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> secured.SecureFiles:
    """A CA, a broker and a client certificate, as `launcher --secure` makes them."""
    files = secured.SecureFiles(tmp_path_factory.mktemp("tls") / "secure")
    secured.ensure(files)
    return files


def sasl_ssl(files: secured.SecureFiles, **values: Any) -> TokenbusSettings:
    return TokenbusSettings(
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_username="edge",
        kafka_sasl_password="s3cret",
        kafka_ssl_cafile=files.ca_cert,
        kafka_ssl_certfile=files.client_cert,
        kafka_ssl_keyfile=files.client_key,
        **values,
    )


def test_plaintext_is_the_default_and_adds_nothing() -> None:
    settings = TokenbusSettings()
    assert settings.kafka_security_protocol == "PLAINTEXT"
    assert client_security(settings) == {"security_protocol": "PLAINTEXT"}


def test_sasl_ssl_settings_reach_aiokafka_with_a_verifying_tls_context(
    tls_files: secured.SecureFiles,
) -> None:
    security = client_security(sasl_ssl(tls_files))
    context = security.pop("ssl_context")
    assert security == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "edge",
        "sasl_plain_password": "s3cret",
    }
    assert isinstance(context, ssl.SSLContext)
    assert context.check_hostname
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert "s3cret" not in repr(sasl_ssl(tls_files))  # SecretStr: never in logs or reprs


@pytest.mark.parametrize(
    ("protocol", "mechanism"),
    [
        ("PLAINTEXT", "SCRAM-SHA-512"),
        ("SSL", "SCRAM-SHA-512"),
        ("SASL_PLAINTEXT", "PLAIN"),
        ("SASL_PLAINTEXT", "SCRAM-SHA-512"),
        ("SASL_SSL", "PLAIN"),
        ("SASL_SSL", "SCRAM-SHA-512"),
    ],
)
async def test_every_factory_client_logs_in_as_the_settings_say(
    tls_files: secured.SecureFiles, protocol: str, mechanism: str
) -> None:
    """Producers, consumers and admin clients get the settings' protocol, a verifying TLS
    context exactly when the protocol has TLS, and the SASL login exactly when it has SASL."""
    tls, sasl = protocol.endswith("SSL"), protocol.startswith("SASL_")
    settings = TokenbusSettings(
        kafka_security_protocol=protocol,
        kafka_sasl_mechanism=mechanism,
        kafka_sasl_username="ingest" if sasl else None,
        kafka_sasl_password="pw" if sasl else None,
        kafka_ssl_cafile=tls_files.ca_cert if tls else None,
    )
    producer = make_producer(settings, client_id="security-test")
    consumer = make_consumer(settings, group_id=None, client_id="security-test")
    admin = make_admin(settings, client_id="security-test")
    # Each one's low-level client opens the connections: what it holds is what the broker sees.
    clients = {"producer": producer.client, "consumer": consumer._client, "admin": admin._client}
    try:
        for name, client in clients.items():
            context = client._ssl_context
            assert isinstance(context, ssl.SSLContext) == tls, name
            if tls:
                assert context.check_hostname, name
                assert context.verify_mode == ssl.CERT_REQUIRED, name
            assert client._security_protocol == protocol, name
            login = (client._sasl_plain_username, client._sasl_plain_password)
            assert login == (("ingest", "pw") if sasl else (None, None)), name
            if sasl:
                assert client._sasl_mechanism == mechanism, name
    finally:
        await producer.stop()
        await consumer.stop()
        await admin.close()


def test_no_admin_client_is_built_outside_the_factory() -> None:
    """An admin client built by hand would log in as nobody: `make_admin` carries security."""
    offenders = []
    for path in python_files():
        relative = path.relative_to(SOURCE_ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name == "AIOKafkaAdminClient" and relative != "shared/kafka.py":
                offenders.append(f"{relative}:{node.lineno}")
    assert not offenders, "use shared.kafka.make_admin: " + ", ".join(offenders)


def test_no_service_builds_a_consumer_outside_the_factory() -> None:
    """A consumer built by hand would not log in: `make_consumer` carries security.
    (Tests may read the PLAINTEXT test broker with raw consumers; services may not.)"""
    offenders = []
    for path in python_files():
        relative = path.relative_to(SOURCE_ROOT).as_posix()
        if relative.split("/")[0] not in ("services", "shared", "tokenbus", "deploy"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name == "AIOKafkaConsumer" and relative != "shared/kafka.py":
                offenders.append(f"{relative}:{node.lineno}")
    assert not offenders, "use shared.kafka.make_consumer: " + ", ".join(offenders)


def test_half_configured_security_fails_at_start(tls_files: secured.SecureFiles) -> None:
    with pytest.raises(ValidationError, match="needs TOKENBUS_KAFKA_SASL_USERNAME"):
        TokenbusSettings(kafka_security_protocol="SASL_SSL", kafka_sasl_username="edge")
    with pytest.raises(ValidationError, match="does not use TLS"):
        TokenbusSettings(kafka_ssl_cafile=tls_files.ca_cert)
    with pytest.raises(ValidationError, match="needs TOKENBUS_KAFKA_SSL_CERTFILE"):
        TokenbusSettings(kafka_security_protocol="SSL", kafka_ssl_keyfile=tls_files.client_key)
    with pytest.raises(ValidationError):
        TokenbusSettings(kafka_security_protocol="SSL", kafka_ssl_cafile="/no/such/ca.pem")


# -- the ACL plan (no broker) -------------------------------------------------------------


def allowed(acls: list[Acl], principal: str, op: Operation, resource: Resource, name: str) -> bool:
    """Kafka's rule for these ACLs: some ALLOW matches, no DENY does; READ/WRITE imply DESCRIBE."""

    def matches(acl: Acl) -> bool:
        named = acl.name == name if acl.pattern is Pattern.LITERAL else name.startswith(acl.name)
        return acl.principal == principal and acl.resource is resource and named

    mine = [a for a in acls if matches(a)]
    if any(a.permission is Permission.DENY and a.operation is op for a in mine):
        return False
    return any(a.permission is Permission.ALLOW and a.operation is op for a in mine)


def test_each_service_gets_only_what_it_uses() -> None:
    topics = Topics("p")
    acls = service_acls(topics)

    def may(role: str, op: Operation, topic: str) -> bool:
        return allowed(acls, f"User:{role}", op, Resource.TOPIC, topic)

    read, write = Operation.READ, Operation.WRITE
    tiers = [topics.tier(t) for t in Tier]
    # The pipeline's hops, each by the one role that makes it.
    assert may("edge", write, topics.requests)
    assert all(may("edge", write, t) for t in tiers)  # its direct path (ADR 0041)
    assert may("ingest", read, topics.requests)
    assert all(may("ingest", write, t) and may("scheduler", read, t) for t in tiers)
    # Ingest reads back what it wrote to rebuild its dedupe memory (services/ingest/memory.py).
    assert all(may("ingest", read, t) for t in [*tiers, topics.dlq])
    assert may("scheduler", write, topics.batches)
    assert may("worker", read, topics.batches)
    assert may("worker", write, topics.results)
    assert may("edge", read, topics.results)
    assert may("worker", write, topics.workers)
    assert may("scheduler", read, topics.workers)
    assert may("edge", write, topics.control)
    assert may("worker", read, topics.control)
    assert may("ingest", read, topics.app_requests("a"))  # each outside app's own (ADR 0044)
    # Nothing more: no role reads another hop's input or writes another hop's output.
    assert not any(may("edge", read, t) for t in tiers)
    assert not may("edge", write, topics.batches)
    assert not may("ingest", write, topics.batches)
    assert not may("worker", write, topics.batches)
    assert not may("worker", read, topics.requests)
    assert not may("ingest", read, topics.results)
    # The edges' lease log is theirs alone, though `p.results.*` matches it too.
    for role in ("ingest", "scheduler", "worker"):
        assert may(role, write, topics.request_results("r1"))
        assert not may(role, write, topics.result_leases)
    assert may("edge", write, topics.result_leases)
    # Recovery and a worker's replay read whether a request was answered (shared/finals.py).
    for role in ("scheduler", "worker"):
        assert may(role, read, topics.results)
        assert may(role, read, f"{reply_prefix(topics)}a")
        assert not may(role, read, topics.result_leases)
    # The response cache: workers store answers, every ingest reads them, nobody else.
    assert may("worker", write, topics.cache)
    assert may("ingest", read, topics.cache)
    assert not may("ingest", write, topics.cache)
    assert not any(may(r, read, topics.cache) for r in ("edge", "scheduler", "worker"))
    assert not any(may(r, write, topics.cache) for r in ("edge", "scheduler"))
    # Rollouts (ADR 0054): every scheduler reads them; the operator (admin) writes them, and
    # a scheduler only to roll a regressed canary back (ADR 0058), as it publishes verdicts.
    assert may("scheduler", read, topics.variants)
    assert may("scheduler", write, topics.variants)
    assert may("scheduler", write, topics.verdicts)
    for topic in (topics.variants, topics.verdicts):
        assert not any(may(r, write, topic) for r in ("edge", "ingest", "worker"))
        assert not any(may(r, read, topic) for r in ("edge", "ingest", "worker"))
    # Shadow validation (ADR 0057): gold workers write scores, schedulers read them; gold
    # runs' streams go to the shadow topic like any reply (worker, scheduler errors).
    assert may("worker", write, topics.scores)
    assert may("scheduler", read, topics.scores)
    assert not any(may(r, write, topics.scores) for r in ("edge", "ingest", "scheduler"))
    assert not any(may(r, read, topics.scores) for r in ("edge", "ingest", "worker"))
    for role in ("worker", "scheduler"):
        assert may(role, write, topics.shadow)
    assert not any(may(r, a, topics.shadow) for r in ("edge", "ingest") for a in (read, write))
    # Only the edge makes and removes topics; every other topic change is the admin's.
    makers = {a.principal for a in acls if a.operation in (Operation.CREATE, Operation.DELETE)}
    assert makers == {"User:edge"}
    # Batches (ADR 0075): the edges run them, as a group; no other service reads them.
    for topic in (topics.batch_jobs, topics.batch_outcomes):
        assert may("edge", read, topic)
        assert may("edge", write, topic)
        assert not any(may(r, read, topic) for r in ("ingest", "scheduler", "worker"))
    # Groups: each consuming service its own; the scheduler also worker groups (recovery).
    groups = {(a.principal, a.name) for a in acls if a.resource is Resource.GROUP}
    assert groups == {
        ("User:edge", "p.batch-runners"),
        ("User:ingest", "p.ingest"),
        ("User:scheduler", "p.scheduler"),
        ("User:scheduler", "p.worker."),
        ("User:worker", "p.worker."),
    }
    # A worker's unfinished batches are re-issued under its own transactional id, by the
    # recovery or by its next process (shared/handover.py): both may write those ids.
    txns = {(a.principal, a.name) for a in acls if a.resource is Resource.TRANSACTIONAL_ID}
    assert txns == {("User:scheduler", "p.worker."), ("User:worker", "p.worker.")}
    assert len(set(acls)) == len(acls)


def test_principals_are_named_per_role() -> None:
    assert parse_principals(["edge=edge-prod", "worker=User:gpu"]) == {
        "edge": "User:edge-prod",
        "worker": "User:gpu",
    }
    with pytest.raises(ValueError, match="ROLE=PRINCIPAL"):
        parse_principals(["gateway=x"])
    acls = service_acls(Topics("p"), {"edge": "User:edge-prod"})
    assert {a.principal for a in acls} == {
        "User:edge-prod",
        *(f"User:{r}" for r in ROLES if r != "edge"),
    }


def test_secured_node_config_has_no_plaintext_client_listener(tmp_path: Path) -> None:
    cluster = launcher.Cluster(port=40000, state_dir=tmp_path, secure=True)
    secured.ensure(cluster.secure_files)
    config = launcher.render_config(cluster, cluster.node(1))
    assert "listeners=SASL_SSL://127.0.0.1:40000,CONTROLLER://127.0.0.1:40001" in config
    assert "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SASL_PLAINTEXT" in config
    assert "inter.broker.listener.name=SASL_SSL" in config
    assert "allow.everyone.if.no.acl.found=false" in config
    assert "listener.name.sasl_ssl.ssl.client.auth=required" in config
    assert "PLAINTEXT://" not in config


def test_a_state_dir_does_not_change_sides(tmp_path: Path) -> None:
    """SCRAM users exist from the storage format on: PLAINTEXT and secured stay apart."""
    plain = launcher.Cluster(port=40000, state_dir=tmp_path)
    plain.node(1).config_file.write_text(launcher.render_config(plain, plain.node(1)))
    assert launcher.Cluster.resolve(state_dir=tmp_path).secure is False
    with pytest.raises(launcher.LauncherError, match="holds a PLAINTEXT cluster"):
        launcher._check_layout(launcher.Cluster(port=40000, state_dir=tmp_path, secure=True))

    secured_dir = tmp_path / "secured"
    cluster = launcher.Cluster(port=40000, state_dir=secured_dir, secure=True)
    secured.ensure(cluster.secure_files)
    cluster.node(1).config_file.write_text(launcher.render_config(cluster, cluster.node(1)))
    # `stop`/`status` without --secure find it secured, as they find its port.
    assert launcher.Cluster.resolve(state_dir=secured_dir).secure is True
    with pytest.raises(launcher.LauncherError, match="holds a secured cluster"):
        launcher._check_layout(launcher.Cluster(port=40000, state_dir=secured_dir))


# -- a secured broker ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(secured_cluster: launcher.Cluster) -> launcher.Cluster:
    """The session's secured broker (tests/conftest.py), which
    tests/security/test_kafka_identity.py shares."""
    return secured_cluster


def settings_of(cluster: launcher.Cluster, user: str, prefix: str) -> TokenbusSettings:
    return settings_from_env(cluster.client_env(user), topic_prefix=prefix)


@pytest.fixture(scope="module")
def secured_stack(cluster: launcher.Cluster, log_dir: Path) -> Iterator[Stack]:
    """Four services, each logged in as its own principal with only its role's ACLs."""

    prefix = new_prefix()
    admin = settings_of(cluster, secured.ADMIN, prefix)
    topics = Topics(prefix)
    # The README's outside application `app`: its own topics, its own grants (ADR 0044).
    asyncio.run(create_topics(admin, topics.app_partitions("app")))
    asyncio.run(create_acls(admin, [*service_acls(topics), *app_acls(topics, "app")]))
    stack = Stack.logged_in(
        cluster,
        prefix,
        log_dir,
        # Security is under test here, not lease timing: a loaded machine may take longer
        # than the default lease (10 s) between an edge's lease and its first renewal.
        env_overrides={"TOKENBUS_EDGE_LEASE_TTL_S": "60", "TOKENBUS_INGEST_APPS": "app"},
        ready_timeout_s=180,
    )
    # The PLAIN login on a real broker; the others log in with SCRAM.
    stack.service_env["ingest"] = cluster.client_env("ingest", mechanism="PLAIN")
    try:
        yield stack.start()
    finally:
        stack.stop()


async def test_chat_end_to_end_with_a_principal_per_service(secured_stack: Stack) -> None:
    requests = [make_request(i) for i in range(6)]
    async with websockets.connect(secured_stack.ws_url) as ws:
        transcripts = await run_requests(ws, requests)
    for r in requests:
        check_transcript(transcripts[r["client_id"]], r)


def test_ingest_recalls_its_memory_well_under_a_request_timeout(secured_stack: Stack) -> None:
    """Ingest's dedupe recall at a partition assignment is quick on SASL_SSL too.

    It took ~30 s here (uvloop's SSL shutdown timeout: a consumer made per recall was
    closed with a response in flight; ADR 0037), long enough to cost ingest its group
    membership. The bound is wide (the machine is loaded); the fault was 30 s.
    """
    log = secured_stack.log("ingest")
    wait_until(lambda: events(log, "memory.recalled"), 120, "ingest's first recall")
    seconds = [float(e["seconds"]) for e in events(log, "memory.recalled")]
    assert max(seconds) < 10, seconds
    assert not events(log, "memory.recall_refused")


def test_kcat_request_with_its_own_login_gets_its_answer(
    cluster: launcher.Cluster, secured_stack: Stack
) -> None:
    """The README's outside producer, as the `app` principal: its own requests topic in, its
    own reply topic (`<prefix>.replies.app`) out (ADR 0044).

    PLAIN over TLS: kcat's librdkafka (2.0.2 on Debian 12) cannot do SCRAM with Kafka 4.
    """
    reply_topic = secured_stack.topics.app_replies("app")
    env = cluster.client_env("app")
    login = [
        *("-b", cluster.bootstrap_servers),
        *("-X", "security.protocol=SASL_SSL", "-X", "sasl.mechanisms=PLAIN"),
        *("-X", f"sasl.username={env['TOKENBUS_KAFKA_SASL_USERNAME']}"),
        *("-X", f"sasl.password={env['TOKENBUS_KAFKA_SASL_PASSWORD']}"),
        *("-X", f"ssl.ca.location={env['TOKENBUS_KAFKA_SSL_CAFILE']}"),
        *("-X", f"ssl.certificate.location={env['TOKENBUS_KAFKA_SSL_CERTFILE']}"),
        *("-X", f"ssl.key.location={env['TOKENBUS_KAFKA_SSL_KEYFILE']}"),
    ]
    request_id = "kcat-" + uuid.uuid4().hex[:8]
    record = {
        "request_id": request_id,
        "prompt": "written by kcat",
        "max_tokens": 12,
        "priority": "background",
        "reply_to": {"topic": reply_topic},
    }
    kcat("-P", *login, "-t", secured_stack.topics.app_requests("app"), "-K", "\t",
         stdin=f"{request_id}\t{json.dumps(record)}\n".encode())  # fmt: skip

    results: list[dict[str, Any]] = []

    def answered() -> bool:
        nonlocal results
        out = kcat("-C", *login, "-t", reply_topic, "-o", "beginning", "-e", "-q", "-f", "%s\n")
        results = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
        return bool(results) and results[-1]["kind"] in ("done", "error")

    wait_until(answered, 90, "the answer on the kcat reply topic", interval=0.5)
    deltas = [r for r in results if r["kind"] == "delta"]
    assert "".join(str(d["text"]) for d in deltas) == complete("written by kcat", 12).text
    assert results[-1]["kind"] == "done", results[-1]

    # The same login may not read anyone else's answers.
    refused = subprocess.run(
        ["kcat", "-C", *login, "-t", secured_stack.topics.results, "-o", "beginning", "-e"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "authoriz" in (refused.stdout + refused.stderr).lower()


async def test_a_principal_is_refused_what_its_role_is_not_granted(
    cluster: launcher.Cluster, secured_stack: Stack
) -> None:
    topics = secured_stack.topics
    edge = settings_of(cluster, "edge", topics.prefix)
    tier = TopicPartition(topics.tier(Tier.interactive), 0)
    # The edge cannot see the batches the scheduler addresses: the broker hides the topic...
    admin = make_admin(edge)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topics.batches])
    finally:
        await admin.close()
    assert described["error_code"] == TopicAuthorizationFailedError.errno
    # ...and it may write a tier topic (ADR 0041), so it sees the topic, but a read of what
    # others queued there is refused.
    consumer = make_consumer(edge, group_id=None, client_id="edge-snooping")
    await consumer.start()
    try:
        consumer.assign([tier])
        await consumer.seek_to_beginning(tier)
        with pytest.raises(TopicAuthorizationFailedError):
            await asyncio.wait_for(consumer.getmany(timeout_ms=5000), 60)
    finally:
        await consumer.stop()

    # ...nor hand a worker a batch, and a worker cannot forge an edge's result lease.
    for user, topic in (("edge", topics.batches), ("worker", topics.result_leases)):
        producer = make_producer(settings_of(cluster, user, topics.prefix), client_id=user)
        await producer.start()
        try:
            with pytest.raises(TopicAuthorizationFailedError):
                await asyncio.wait_for(producer.send_and_wait(topic, b"forged"), 60)
        finally:
            await producer.stop()


def ingest_acls_without_the_dlq(topics: Topics, *extra: Acl) -> list[Acl]:
    """Ingest's grants with its DLQ grant (READ, WRITE) taken out, plus `extra`."""
    mine = ("User:ingest", topics.dlq)
    return [*(a for a in service_acls(topics) if (a.principal, a.name) != mine), *extra]


@pytest.mark.parametrize(
    ("dlq_grant", "refused"),
    [
        (None, "DESCRIBE"),  # the DLQ is hidden: its partitions cannot be listed
        (Operation.WRITE, "READ"),  # seen (WRITE implies DESCRIBE), but not readable
    ],
)
async def test_a_recall_refused_names_the_topic_and_the_missing_operation(
    cluster: launcher.Cluster, dlq_grant: Operation | None, refused: str
) -> None:
    """A missing ACL fails the recall at once with the topic and the operation to grant,
    rather than a silent skip (the DLQ's dead-letter memory lost) or a wait."""
    topics = Topics(new_prefix())
    admin = settings_of(cluster, secured.ADMIN, topics.prefix)
    await create_topics(admin, topics.partitions())
    extra = [] if dlq_grant is None else [
        Acl("User:ingest", Resource.TOPIC, topics.dlq, Pattern.LITERAL, dlq_grant)
    ]  # fmt: skip
    await create_acls(admin, ingest_acls_without_the_dlq(topics, *extra))
    writer = make_producer(admin, client_id="dlq-writer")
    await writer.start()
    try:
        await writer.send_and_wait(topics.dlq, b"{}", key=b"r1")  # something to read
    finally:
        await writer.stop()

    ingest = settings_of(cluster, "ingest", topics.prefix)
    ingest_admin = make_admin(ingest, client_id="ingest-admin")
    tails = make_consumer(ingest, group_id=None, client_id="ingest-recall")
    await ingest_admin.start()
    await tails.start()
    began = time.monotonic()
    try:
        with pytest.raises(RecallRefused) as refusal:
            await asyncio.wait_for(recall(Memory.of_size(10), topics, ingest_admin, tails, 10), 60)
    finally:
        await tails.stop()
        await ingest_admin.close()
    assert (refusal.value.topic, refusal.value.operation) == (topics.dlq, refused)
    assert f"{refused} topic '{topics.dlq}'" in str(refusal.value)
    assert time.monotonic() - began < 10, "a refusal must not be waited out"


# -- closing a client mid-request on TLS ----------------------------------------------------


async def timed(stop: Awaitable[None]) -> float:
    began = time.monotonic()
    await stop
    return time.monotonic() - began


def test_clients_stopped_mid_request_on_tls_stop_at_once(cluster: launcher.Cluster) -> None:
    """On the services' own loop, a consumer stopped with a response on its way stops at once.

    On uvloop's defaults a consumer stopped with a request in flight (here `end_offsets`,
    as ingest's recall did) took 30.0 s to stop, every try: closing a TLS connection waited
    for the broker's close_notify, which did not come, until uvloop's SSL shutdown timeout
    (ADR 0040). One stopped right after `assign()` (a metadata refresh) met it in some
    tries. Three tries each. The bound is wide (the machine is loaded); the fault was 30 s.
    """
    topics = Topics(new_prefix())
    admin = settings_of(cluster, secured.ADMIN, topics.prefix)
    partition = TopicPartition(topics.dlq, 0)

    async def stop_times() -> dict[str, list[float]]:
        await create_topics(admin, {topics.dlq: 1})
        seconds: dict[str, list[float]] = {"assigned": [], "asking": []}
        for _ in range(3):
            consumer = make_consumer(admin, group_id=None, client_id="tls-close")
            await consumer.start()
            consumer.assign([partition])  # starts a metadata refresh
            # One turn of the loop: the refresh goes out (and aiokafka's own task that
            # `stop` cancels gets to start; cancelled before it does, `stop` raises).
            await asyncio.sleep(0)
            seconds["assigned"].append(await timed(consumer.stop()))

            consumer = make_consumer(admin, group_id=None, client_id="tls-close")
            await consumer.start()
            consumer.assign([partition])
            await consumer.seek_to_end(partition)  # the metadata is in: asking goes out at once
            asking = asyncio.ensure_future(consumer.end_offsets([partition]))
            for _ in range(3):  # until the request is written, not answered yet
                await asyncio.sleep(0)
            seconds["asking"].append(await timed(consumer.stop()))
            asking.cancel()
        return seconds

    with asyncio.Runner(loop_factory=new_service_loop) as runner:
        seconds = runner.run(stop_times())
    print(seconds)
    assert all(s < 5 for tries in seconds.values() for s in tries), seconds


async def test_a_wrong_password_is_named_not_waited_out(cluster: launcher.Cluster) -> None:
    env = {**cluster.client_env(secured.ADMIN), "TOKENBUS_KAFKA_SASL_PASSWORD": "wrong"}
    began = time.monotonic()
    with pytest.raises(KafkaLoginRefused, match="refused the login of admin"):
        await wait_for_broker(settings_from_env(env), timeout_s=120)
    assert time.monotonic() - began < 60, "a refused login must not be retried until timeout"


def test_a_service_with_a_wrong_password_exits_naming_the_failure(
    cluster: launcher.Cluster, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        **cluster.client_env("scheduler"),
        "TOKENBUS_KAFKA_SASL_PASSWORD": "wrong",
        "TOKENBUS_TOPIC_PREFIX": new_prefix(),
        "PYTHONPATH": str(ROOT),
    }
    log = tmp_path / "scheduler.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.scheduler"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode != 0
    text = log.read_text()
    assert "SaslAuthenticationFailed" in text, text[-3000:]
    assert "invalid credentials" in text
