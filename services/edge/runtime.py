"""The edge's Kafka side, built whole or not at all: clients, broker link, result reader,
topology, gateway and background loops.

`running` yields the gateway fully formed and, on exit, takes down what was built in reverse
order, whichever step failed (an `AsyncExitStack`, as Starlette's lifespan does): a client
that fails to start no longer leaks the ones started before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import structlog
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from services.edge.auth import Guard
from services.edge.broker_link import BrokerLink
from services.edge.gateway import Gateway
from services.edge.lease_keeper import LeaseKeeper, LeaseLost, TopicNotReady, ensure_lease_topic
from services.edge.metrics import EdgeMetrics
from services.edge.openai.edge_streams import EdgeStreams
from services.edge.replay import REPLAY_FETCH_WAIT_MS, REPLAY_REQUEST_TIMEOUT_MS, Replays
from services.edge.results import ResultReader
from services.edge.resume import ResumeKeys
from services.edge.settings import EdgeSettings
from services.edge.sweeper import TopicSweeper
from services.edge.telemetry import EdgeTelemetry
from services.edge.topology import PartitionTopology, ResultTopology, TopicTopology, reply_tp
from shared.kafka import (
    client_security,
    make_admin,
    make_consumer,
    make_producer,
    topic_partitions,
)
from shared.messages import ReplyTo
from shared.process import for_life
from shared.producers import RenewingProducer
from shared.retry import Backoff, retrying
from shared.stacks import dump_on_signals
from shared.topics import Topics

log = structlog.get_logger()

# A failed background loop is restarted after 0.5 s, doubling up to 10 s.
RESTART_MIN_S = 0.5
RESTART_MAX_S = 10.0


class EdgeParts(Protocol):
    """What lives for the whole edge process (app.py's `Edge`), which the Kafka side uses."""

    @property
    def settings(self) -> EdgeSettings: ...
    @property
    def topics(self) -> Topics: ...
    @property
    def edge_id(self) -> str: ...
    @property
    def metrics(self) -> EdgeMetrics: ...
    @property
    def telemetry(self) -> EdgeTelemetry: ...
    @property
    def guard(self) -> Guard: ...
    @property
    def resume_keys(self) -> ResumeKeys: ...
    @property
    def openai(self) -> EdgeStreams: ...


@contextlib.asynccontextmanager
async def running(parts: EdgeParts, on_lease_lost: Callable[[], None]) -> AsyncIterator[Gateway]:
    """The gateway, with every client and loop it needs started; all stopped on exit."""
    s, topics, edge_id = parts.settings, parts.topics, parts.edge_id
    dump_on_signals(asyncio.get_running_loop())
    async with contextlib.AsyncExitStack() as stack:
        producer = RenewingProducer(lambda: make_producer(s, client_id=edge_id))
        await producer.start()
        stack.push_async_callback(producer.stop)
        admin = make_admin(s, client_id=edge_id)
        await admin.start()
        stack.push_async_callback(admin.close)
        # Partition topology: the reader's partitions rarely change (a resume of another
        # edge's stream), so its fetch is a long poll, which returns as soon as a result or
        # control record arrives; a change of partitions waits out the one in flight (up
        # to `long_poll_ms`). Idle, this saves most of the edge's and the broker's CPU (ADR
        # 0041 has the figures). Topic topology follows a new topic per
        # request, whose first tokens must not wait on a long poll: the short default.
        partitioned = s.edge_result_topology == "partition"
        consumer = make_consumer(
            s,
            group_id=None,
            client_id=edge_id,
            long_poll=partitioned,
        )
        await consumer.start()
        stack.push_async_callback(consumer.stop)
        link = BrokerLink(
            producer,
            admin,
            topics,
            produce_timeout_s=s.edge_produce_timeout_s,
            produce_wait_s=s.edge_produce_wait_s,
            security=client_security(s),
            retry_after_ms=s.edge_retry_after_ms,
            metrics=parts.metrics,
            edge_id=edge_id,
        )
        reader = ResultReader(
            consumer,
            TopicPartition(topics.control, 0),
            # Every partition: each carries every beat, but one may be away (ADR 0056).
            side=dict.fromkeys(
                # Retried like the lease: a node down at start answers NodeNotReadyError
                # (stop 15's clean clone: edge-a exited with code 3, restarted 13 s later).
                await retrying(
                    lambda: topic_partitions(
                        admin, topics.workers, topics.partitions()[topics.workers]
                    ),
                    within_s=None,
                    what="heartbeat_partitions",
                    retry_on=(KafkaError, TimeoutError),
                ),
                parts.openai.heartbeat,
            ),
        )
        models_since = time.time() - s.edge_models_stale_s  # `/v1/models` knows workers at once
        keeper: LeaseKeeper | None = None
        topology: ResultTopology
        if partitioned:
            keeper = LeaseKeeper(
                s, topics.result_leases, edge_id, lambda: producer, s.edge_lease_ttl_s, link.sent
            )
            stack.push_async_callback(keeper.release)
            partition = await lease_partition(s, topics, link, keeper)
            # Renewed from now on, not once the edge serves: the start that follows can
            # outlast a short lease (stop 17's clean clone: 2.3 s against a 3 s TTL, and
            # another edge took the partition). Stopped before the release, on exit.
            renewing = asyncio.create_task(keep_lease(keeper, on_lease_lost), name="edge-lease")
            stack.push_async_callback(_cancel, [renewing])
            reply_to = ReplyTo(topic=topics.results, partition=partition)
            topology = PartitionTopology(reply_to, reader)
            await reader.start(reply_tp(reply_to), models_since)
        else:
            retention_s = s.edge_result_topic_retention_s
            topology = TopicTopology(topics, admin, reader, retention_s, parts.metrics)
            await reader.start(None, models_since)
        replays = Replays(
            lambda: make_consumer(
                s,
                group_id=None,
                client_id=f"{edge_id}-replay",
                fetch_max_wait_ms=REPLAY_FETCH_WAIT_MS,
                request_timeout_ms=REPLAY_REQUEST_TIMEOUT_MS,
            ),
            timeout_s=s.edge_resume_timeout_s,
            max_records=s.edge_resume_max_records,
            concurrency=s.edge_resume_replays,
        )
        stack.push_async_callback(replays.aclose)  # after the resumes' handlers ended
        gateway = Gateway(
            s,
            topics,
            edge_id,
            link=link,
            topology=topology,
            reader=reader,
            guard=parts.guard,
            telemetry=parts.telemetry,
            metrics=parts.metrics,
            resume_keys=parts.resume_keys,
            models=parts.openai.models,
            replays=replays,
        )
        sweeper = TopicSweeper(
            admin,
            s,
            topics,
            gateway.reads_topic,
            parts.metrics,
            s.edge_result_topic_orphan_after_s,
            s.edge_result_topic_sweep_interval_s,
        )
        tasks: list[asyncio.Task[None]] = []
        stack.push_async_callback(_cancel, tasks)  # first to run on exit
        # Each keeps its state outside the coroutine, so a failed one is restarted.
        loops: dict[str, Callable[[], Awaitable[None]]] = {
            "edge-results": lambda: reader.run(gateway),
            "edge-housekeeping": gateway.housekeeping,
            "edge-broker-probe": link.probe,
            "edge-sweeper": sweeper.run,
            "edge-revocations": parts.guard.watch_revocations,
        }
        for name, loop in loops.items():
            tasks.append(asyncio.create_task(supervised(name, loop, parts.metrics), name=name))
        log.info(
            "edge.started",
            edge_id=edge_id,
            topology=s.edge_result_topology,
            partition=keeper.partition if keeper else None,
            port=s.edge_port,
        )
        yield gateway


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    # Failures were logged when they happened (`supervised`); shut down regardless.
    await asyncio.gather(*tasks, return_exceptions=True)


async def supervised(name: str, loop: Callable[[], Awaitable[None]], metrics: EdgeMetrics) -> None:
    """Run a background loop for the edge's life; restart it with backoff if it fails.

    A dead loop would leave the edge accepting requests it cannot serve, and killing
    the process would close every socket: the failure is logged and the loop resumes
    from the state it keeps outside itself (positions, deadlines).

    Every loop runs until the edge stops, so a loop that returns, or that ends cancelled
    while the edge is not cancelling it (a stray `CancelledError` from inside, as in ADR
    0039's wedge), has failed too: it is logged and restarted, never ended in silence.
    """
    backoff = Backoff(RESTART_MIN_S, RESTART_MAX_S)
    while True:
        started = time.monotonic()
        try:
            await for_life(name, loop())  # a return or an inner cancel raises LoopEnded
        except Exception as exc:
            if time.monotonic() - started > RESTART_MAX_S:
                backoff.reset()  # it ran fine for a while: a new failure
            wait = backoff.next()
            log.exception("edge.task_failed", task=name, error=repr(exc), restart_in_s=wait)
        metrics.task_restarts.labels(name).inc()
        await asyncio.sleep(wait)


async def lease_partition(
    s: EdgeSettings, topics: Topics, link: BrokerLink, keeper: LeaseKeeper
) -> int:
    """Lease a results partition; waits out a cluster that cannot answer yet.

    A broker node away, or a results topic not yet in a fresh or restarted broker's
    metadata, is retried with backoff and logged (`write.retry`, what=lease_partition),
    never an exit: an edge that exited here crash-looped until the node was back
    (docs/reliability.md, finding 4).
    """

    async def attempt() -> int:
        await ensure_lease_topic(link.admin, topics.result_leases, s.edge_lease_ttl_s)
        partitions = await link.partition_count(topics.results)
        if partitions is None:
            raise TopicNotReady(f"{topics.results} is not in the cluster's metadata yet")
        wanted = s.edge_result_partition
        if wanted is not None and wanted >= partitions:
            raise RuntimeError(f"edge_result_partition={wanted}, but the topic has {partitions}")
        return await keeper.acquire(partitions, wanted, timeout_s=2.5 * s.edge_lease_ttl_s)

    return await retrying(
        attempt,
        within_s=None,
        what="lease_partition",
        retry_on=(KafkaError, TimeoutError, TopicNotReady),
    )


async def keep_lease(keeper: LeaseKeeper, on_lost: Callable[[], None]) -> None:
    try:
        await keeper.keep()
    except LeaseLost as exc:
        # Another edge may own the partition now: serving from it would share it.
        # Only the log says so (another edge's claim won), never a missed renewal.
        log.error("lease.lost", error=str(exc), action="shutting down")
        on_lost()
