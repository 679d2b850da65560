"""A real three-node KRaft cluster from the launcher: replicated topics, and writes through a crash.

The cluster is the session's three-node one (`three_nodes`, tests/conftest.py: clients reach
each node through a Toxiproxy proxy with no toxic), never the shared broker; each test takes
it with every node up, and names its topics by a prefix of its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError

from deploy.kafka import launcher
from shared import finals, resets
from shared.kafka import create_topics, make_admin, make_producer
from shared.messages import DoneResult, QueuedRequest, ReplyTo, Tier, Timings, Usage
from shared.results import send_result
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tests.built_tools import WAITS_FOR_BUILD
from tests.chaos.toxiproxy import ProxiedCluster
from tests.processes import running
from tests.stack import Stack, new_prefix, read_partition, wait_until

# `three_nodes` waits for the Toxiproxy server if make test is still building it.
pytestmark = [pytest.mark.integration, WAITS_FOR_BUILD]

# The console script pyproject declares, from the environment running the tests.
TOKENBUS = Path(sys.executable).parent / "tokenbus"


@pytest.fixture
def cluster(three_nodes: ProxiedCluster) -> launcher.Cluster:
    """The session's cluster with every node running, whatever an earlier test left dead."""
    return three_nodes.whole().cluster


def settings_for(cluster: launcher.Cluster) -> TokenbusSettings:
    return TokenbusSettings(
        KAFKA_BOOTSTRAP_SERVERS=cluster.bootstrap_servers, topic_prefix=new_prefix()
    )


@asynccontextmanager
async def admin_of(settings: TokenbusSettings) -> AsyncIterator[AIOKafkaAdminClient]:
    admin = make_admin(settings)
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


async def partitions_of(admin: AIOKafkaAdminClient, topic: str) -> list[dict[str, Any]]:
    """The topic's partitions, once the node asked knows it (a new topic reaches each node
    of a cluster a moment after it is created)."""

    async def described() -> list[dict[str, Any]]:
        try:
            [entry] = await admin.describe_topics([topic])
        except KafkaError:  # asked a node that is down (aiokafka does not try another)
            return []
        partitions: list[dict[str, Any]] = entry["partitions"]
        return sorted(partitions, key=lambda p: int(p["partition"]))

    found: list[dict[str, Any]] = await wait_for(f"metadata of {topic}", 30, described)
    return found


async def topic_config(admin: AIOKafkaAdminClient, topic: str, name: str) -> str:
    """One config of a topic, once the node asked knows the topic (as `partitions_of`)."""
    resource = ConfigResource(ConfigResourceType.TOPIC, topic, {name: None})

    async def described() -> str | None:
        try:
            answer = (await admin.describe_configs([resource]))[0].to_object()
        except KafkaError:  # asked a node that is down
            return None
        entries = answer["resources"][0]["config_entries"]
        values = {e["config_names"]: e["config_value"] for e in entries}
        return None if name not in values else str(values[name])

    value: str = await wait_for(f"{name} of {topic}", 30, described)
    return value


async def wait_for(what: str, timeout_s: float, check: Any) -> Any:
    """Await `check()` until it returns something truthy; fail naming `what` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.2)


def test_every_node_runs_and_knows_the_other_two(cluster: launcher.Cluster) -> None:
    # The bootstrap string of a plain cluster: tests/test_launcher.py; of a proxied one:
    # tests/chaos/test_toxiproxy.py.
    assert set(launcher.running_pids(cluster)) == {1, 2, 3}
    assert all(launcher.broker_ids(n.port) == {1, 2, 3} for n in cluster.nodes)


async def test_deployment_topics_get_three_replicas_and_two_in_sync_heartbeats_one_per_node(
    cluster: launcher.Cluster,
) -> None:
    settings = settings_for(cluster)
    wanted = Topics(settings.topic_prefix).partitions()
    assert sorted(await create_topics(settings, wanted)) == sorted(wanted)
    single = Topics(settings.topic_prefix).single_copy()
    async with admin_of(settings) as admin:
        for topic, count in wanted.items():
            partitions = await partitions_of(admin, topic)
            assert len(partitions) == count, topic
            if topic in single:
                # Heartbeats (ADR 0056): one copy per partition, one partition per node.
                assert sorted(r for p in partitions for r in p["replicas"]) == [1, 2, 3], topic
                assert await topic_config(admin, topic, "min.insync.replicas") == "1", topic
                continue
            assert all(sorted(p["replicas"]) == [1, 2, 3] for p in partitions), topic
            assert await topic_config(admin, topic, "min.insync.replicas") == "2", topic


async def test_an_explicit_replication_factor_wins_and_min_isr_follows(
    cluster: launcher.Cluster,
) -> None:
    settings = settings_for(cluster)
    topic = f"{settings.topic_prefix}.single"
    await create_topics(settings, {topic: 1}, replication=1)
    async with admin_of(settings) as admin:
        [partition] = await partitions_of(admin, topic)
        assert len(partition["replicas"]) == 1
        assert await topic_config(admin, topic, "min.insync.replicas") == "1"


async def test_writes_survive_the_leaders_kill_and_its_restart(cluster: launcher.Cluster) -> None:
    settings = settings_for(cluster)
    topic = f"{settings.topic_prefix}.through-a-crash"
    await create_topics(settings, {topic: 1})
    producer = make_producer(settings, client_id="cluster-test")
    await producer.start()
    async with admin_of(settings) as admin:
        try:
            sent = [f"before-{i}".encode() for i in range(20)]
            for value in sent:
                await producer.send_and_wait(topic, value, partition=0)
            [partition] = await partitions_of(admin, topic)
            leader = int(partition["leader"])
            killed = launcher.kill_node(cluster, leader)
            assert killed is not None
            assert not running(killed)

            # acks=all with min ISR 2: the two survivors take the writes once one leads.
            during = [f"during-{i}".encode() for i in range(20)]
            for value in during:
                await asyncio.wait_for(producer.send_and_wait(topic, value, partition=0), 90)
            sent += during

            async def led_by_another() -> bool:
                [p] = await partitions_of(admin, topic)
                return int(p["leader"]) not in (leader, -1)

            await wait_for("a new leader", 60, led_by_another)

            pid = await asyncio.to_thread(launcher.start_node, cluster, leader)
            assert pid != killed
            assert running(pid)

            async def back_in_sync() -> bool:
                [p] = await partitions_of(admin, topic)
                return sorted(p["isr"]) == [1, 2, 3]

            await wait_for(f"node {leader} back in the ISR", 90, back_in_sync)
            after = [f"after-{i}".encode() for i in range(20)]
            for value in after:
                await producer.send_and_wait(topic, value, partition=0)
            sent += after
        finally:
            await producer.stop()

    # Every write once, in order: acks=all lost none, idempotence duplicated none.
    assert await read_partition(settings, TopicPartition(topic, 0), len(sent), within_s=60) == sent


async def test_a_final_behind_a_hung_replica_is_found_once_its_partition_is_settled(
    cluster: launcher.Cluster,
) -> None:
    """Finding 11 (ADR 0050). While a follower is hung, a record the leader holds is not
    readable (acks=all: the high watermark waits for every in-sync replica), so a hand-back
    that asked for finals then missed a `done` the worker had written, and announced the
    next attempt after it: the request was answered twice. Settled first (a reset of the
    running attempt, stored), the partition shows the `done`."""
    settings = settings_for(cluster)
    topic = f"{settings.topic_prefix}.replies"
    await create_topics(settings, {topic: 1})
    request = QueuedRequest(
        request_id="settle-1",
        prompt="p",
        tier=Tier.interactive,
        prompt_tokens=1,
        reply_to=ReplyTo(topic=topic, partition=0),
    )
    done = DoneResult(
        request_id=request.request_id,
        seq=1,
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        timings=Timings(queue_ms=1.0, batch_size=1, ttft_ms=1.0, total_ms=2.0),
    )
    since_ms = int(time.time() * 1000) - 1000
    worker = make_producer(settings, client_id="settle-worker")
    scheduler = make_producer(settings, client_id="settle-scheduler")
    await worker.start()
    await scheduler.start()
    async with admin_of(settings) as admin:

        async def all_in_sync() -> dict[str, Any] | None:
            [p] = await partitions_of(admin, topic)
            return p if sorted(p["isr"]) == [1, 2, 3] else None

        partition = await wait_for("three replicas in sync", 60, all_in_sync)
        follower = next(n for n in partition["replicas"] if n != partition["leader"])
        for producer in (worker, scheduler):  # each knows the leader before a node hangs
            await producer.partitions_for(topic)
        pid = launcher.running_pids(cluster)[follower]
        os.kill(pid, signal.SIGSTOP)
        try:
            stored = await send_result(worker, request.reply_to, done)
            # In the leader's log, not yet readable: what the recovery read before.
            unsettled = await finals.read_back(
                settings, [request], since_ms, 3.0, client_id="settle-unsettled"
            )
            assert unsettled.answered == set()
            assert not stored.done()
            assert await resets.settle(scheduler, [request])
            settled = await finals.read_back(
                settings, [request], since_ms, 10.0, client_id="settle-settled"
            )
            assert settled.answered == {request.request_id}
            await asyncio.wait_for(stored, 30)  # the worker's write is acknowledged too
        finally:
            os.kill(pid, signal.SIGCONT)
            await worker.stop()
            await scheduler.stop()
        await wait_for(f"node {follower} back in sync", 90, all_in_sync)


def test_a_hung_node_silences_no_worker(cluster: launcher.Cluster, log_dir: Path) -> None:
    """ADR 0056 (finding 11's reading, finding 13). With one replicated heartbeat partition, a
    hung node held back its high watermark (a replica away stalls acks=all until the
    controller fences the node, 6 s), so no beat was readable: the scheduler declared every
    worker dead and each worker fenced itself. On single-copy partitions, one per node, the
    beats on the other nodes' partitions carry on through the hang, and through a node's
    kill and restart."""
    stack = Stack(
        bootstrap=cluster.bootstrap_servers,
        prefix=new_prefix(),
        log_dir=log_dir,
        workers={k: {"TOKENBUS_WORKER_ID": k} for k in ("hang-a", "hang-b")},
        ready_timeout_s=180,
    )
    scheduler, workers = stack.log("scheduler"), [stack.log(k) for k in stack.workers]

    def text(path: Path) -> str:
        return path.read_text(errors="replace") if path.exists() else ""

    def silenced() -> list[str]:
        found = [f"{scheduler.name}: worker.dead"] if "worker.dead" in text(scheduler) else []
        return found + [f"{w.name}: {e}" for w in workers for e in FENCED if e in text(w)]

    try:
        stack.start()
        wait_until(
            lambda: text(scheduler).count("worker.registered") >= 2, 120, "both workers heard"
        )
        # A node leading a heartbeat partition (each node leads one): node 2.
        pid = launcher.running_pids(cluster)[2]
        os.kill(pid, signal.SIGSTOP)
        try:
            # Hold the hang past the death threshold (1.5 s) and the controller's fencing
            # (6 s), watching for a death all along.
            until = time.monotonic() + 8.0
            while time.monotonic() < until:
                assert not silenced(), silenced()
                time.sleep(0.2)
        finally:
            os.kill(pid, signal.SIGCONT)
        until = time.monotonic() + 5.0
        while time.monotonic() < until:  # and while the node catches up
            assert not silenced(), silenced()
            time.sleep(0.2)
        # A node killed and started again: its partition has no leader meanwhile, and while
        # it starts its port opens before it answers (a refresh that asks it waits: one
        # producer for all partitions stalled every beat; `beat_producers.py`).
        killed = launcher.kill_node(cluster, 3)
        assert killed is not None
        launcher.start_node(cluster, 3)
        until = time.monotonic() + 8.0
        while time.monotonic() < until:
            assert not silenced(), silenced()
            time.sleep(0.2)
        assert stack.exited() == {}
    finally:
        stack.stop()


FENCED = ("worker.fenced", "worker.silent")


def test_cli_status_names_a_dead_node_and_start_brings_it_back(
    cluster: launcher.Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    killed = launcher.kill_node(cluster, 3)
    assert killed is not None
    args = ["status", "--state-dir", str(cluster.state_dir)]
    assert launcher.main(args) == 1
    out = capsys.readouterr().out
    assert f"node 3 at {cluster.node(3).bootstrap_server}: not running" in out
    assert "2 of 3 nodes serving" in out
    assert launcher.main(["start", "--state-dir", str(cluster.state_dir)]) == 0
    assert "1 of 3 nodes up" in capsys.readouterr().out
    assert launcher.main(args) == 0
    assert launcher.running_pids(cluster)[3] != killed


def test_cli_status_start_again_and_a_conflicting_nodes_on_the_running_cluster(
    cluster: launcher.Cluster,
) -> None:
    """The launcher's CLI, as users run it, on the three nodes it started: the state dir is
    all it needs (no --nodes, no --port); a second start starts nothing; another size is
    refused. (Its stop stops every node: the session's teardown, `three_nodes`, checks.)"""
    pids = [launcher.running_pids(cluster)[i] for i in (1, 2, 3)]
    where = ("--state-dir", str(cluster.state_dir))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "deploy.kafka.launcher", *args],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    status = cli("status", *where)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"running at {cluster.bootstrap_servers}" in status.stdout
    again = cli("start", *where)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already running" in again.stdout
    assert [launcher.running_pids(cluster)[i] for i in (1, 2, 3)] == pids
    one = cli("start", "--nodes", "1", *where)
    assert one.returncode == 1
    assert "holds a 3-node cluster" in one.stderr
    assert all(running(pid) for pid in pids)


def test_topics_create_cli_replicates_by_default_and_takes_a_factor(
    cluster: launcher.Cluster,
) -> None:

    def topics_create(prefix: str, *args: str) -> str:
        env = dict(
            os.environ,
            KAFKA_BOOTSTRAP_SERVERS=cluster.bootstrap_servers,
            TOKENBUS_TOPIC_PREFIX=prefix,
        )
        result = subprocess.run(
            [str(TOKENBUS), "topics", "create", *args],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    prefix = new_prefix()
    out = topics_create(prefix)
    assert f"created  {prefix}.batches (4 partitions, replication 3, min.insync.replicas 2)" in out
    assert f"existed  {prefix}.batches" in topics_create(prefix)
    other = new_prefix()
    out = topics_create(other, "--replication-factor", "2")
    assert f"created  {other}.batches (4 partitions, replication 2, min.insync.replicas 1)" in out
