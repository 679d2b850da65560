"""One producer per heartbeat partition: a partition whose node is away holds up no other.

aiokafka's sender, while any partition it holds records for has no known leader (its node
was killed), waits on a metadata refresh before it sends anything more, to any partition;
a refresh that asks a node which is starting up (its port open, not yet answering) waits
out the request timeout. With one producer for the three heartbeat partitions, a killed
node's restart stopped every beat for seconds, and schedulers declared the worker dead
(chaos run, ADR 0056). Each partition gets its own producer (acks=1, no idempotence: a
late beat is worth nothing), on its own connections, with a short request timeout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from services.worker.settings import WorkerSettings
from shared.kafka import make_producer
from shared.producers import RenewingProducer
from shared.topics import Topics

# A beat's request waits at most this long: a refresh stuck on a starting node gives up
# and asks another one, and a partition gets its next beat no later than this.
REQUEST_TIMEOUT_MS = 3000


class BeatProducers:
    """Caller: the worker (`start`, `stop`) and its heartbeats (`by_partition`)."""

    def __init__(self, settings: WorkerSettings) -> None:
        self._settings = settings
        self.topic = Topics(settings.topic_prefix).workers
        self._first = self._make("beats")
        self._by_partition: dict[int, RenewingProducer] = {}

    def _make(self, name: str) -> RenewingProducer:
        s = self._settings
        client_id = f"worker-{s.worker_id}-{name}"
        return RenewingProducer(
            lambda: make_producer(
                s, client_id=client_id, request_timeout_ms=REQUEST_TIMEOUT_MS, durable=False
            )
        )

    async def start(self) -> None:
        """Start a producer for each partition the cluster has (the first one learns them).

        Each learns the topic's metadata here: a producer starts knowing no topic, and its
        first send would otherwise ask for it then, from a node that may hang.
        """
        await self._first.start()
        try:
            partitions = sorted(await self._first.partitions_for(self.topic))
            self._by_partition = {partitions[0]: self._first}
            for partition in partitions[1:]:
                producer = self._make(f"beats-{partition}")
                await producer.start()
                self._by_partition[partition] = producer
                await producer.partitions_for(self.topic)
        except BaseException:
            await self.stop()  # the caller stops only what started whole
            raise

    async def stop(self) -> None:
        for producer in {id(p): p for p in [self._first, *self._by_partition.values()]}.values():
            with contextlib.suppress(Exception):
                await producer.stop()

    @property
    def by_partition(self) -> Mapping[int, RenewingProducer]:
        return self._by_partition
