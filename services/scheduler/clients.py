"""The scheduler's Kafka clients, built from its settings, started and stopped as one."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient

from services.scheduler.settings import SchedulerSettings
from shared.kafka import make_admin, make_consumer, make_producer
from shared.producers import RenewingProducer
from shared.topics import Topics


@dataclass(frozen=True)
class Clients:
    """The scheduler's Kafka clients, built from its settings; `started()` runs them."""

    producer: RenewingProducer
    tiers: AIOKafkaConsumer  # the group's tier topics: requests
    beats: AIOKafkaConsumer  # heartbeats, assigned
    log_reader: AIOKafkaConsumer  # the batches topic, read at take-over and recovery
    variants: AIOKafkaConsumer  # the models' rollouts, assigned, read whole (variants.py)
    scores: AIOKafkaConsumer  # shadow scores, every partition, a window back (scores.py)
    admin: AIOKafkaAdminClient

    @classmethod
    def make(cls, s: SchedulerSettings) -> Clients:
        client_id = f"scheduler-{s.scheduler_id}"
        # A configured id is a stable identity: static membership lets a restarted process
        # take its partitions back at once instead of after the session timeout.
        static_id = s.scheduler_id if "scheduler_id" in s.model_fields_set else None
        return cls(
            # Renewed if an outage breaks its sequence numbers (shared/producers.py).
            producer=RenewingProducer(lambda: make_producer(s, client_id=client_id)),
            tiers=make_consumer(
                s,
                group_id=f"{s.topic_prefix}.scheduler",
                client_id=client_id,
                # Hand-backs of a recovery that aborted must stay invisible.
                isolation_level="read_committed",
                group_instance_id=static_id,
                long_poll=True,
            ),
            beats=make_consumer(
                s,
                group_id=None,
                client_id=f"{client_id}-beats",
                auto_offset_reset="latest",
                long_poll=True,
            ),
            log_reader=make_consumer(s, group_id=None, client_id=f"{client_id}-log"),
            variants=make_consumer(s, group_id=None, client_id=f"{client_id}-variants"),
            scores=make_consumer(
                s,
                Topics(s.topic_prefix).scores,
                group_id=None,  # subscribed without a group: every partition, found anew
                client_id=f"{client_id}-scores",
                auto_offset_reset="latest",
                long_poll=True,
            ),
            admin=make_admin(s, client_id=client_id),
        )

    @contextlib.asynccontextmanager
    async def started(self) -> AsyncIterator[Clients]:
        """All but the tier consumer, started (it starts once the scheduler has subscribed)."""
        async with contextlib.AsyncExitStack() as stack:
            await self.producer.start()
            stack.push_async_callback(self.producer.stop)
            await self.admin.start()
            stack.push_async_callback(self.admin.close)
            for consumer in (self.log_reader, self.beats, self.variants, self.scores):
                await consumer.start()
                stack.push_async_callback(consumer.stop)
            stack.push_async_callback(self.tiers.stop)
            yield self
