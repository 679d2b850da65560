"""The batch runner in each edge (ADR 0075): the edges share out the partitions of
`tokenbus.batch-jobs` as the consumer group `tokenbus.batch-runners`, and the edge that
holds a partition runs its batches (batch_job.py).

Each partition is read from its start on assignment (a table, never committed): a batch
starts once the partition is read to where it ended at assignment, so a batch that ended
before is never run again. A cancel record stops its batch. A partition taken away stops
its batches here; the next holder runs them on from what is on the bus.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition

from services.edge.batch_job import BatchParts, BatchRun
from shared.batch_jobs import CANCEL, ENDED, BatchCancel, BatchJob, parse
from shared.kafka import make_consumer
from shared.rebalance import Rebalance

log = structlog.get_logger()

FETCH_MS = 1000


class Partition:
    """One held partition: its batches as read, and the runs started from them."""

    def __init__(self, end: int) -> None:
        self.end = end  # where it ended at assignment: read to here, batches may start
        self.read_up = end == 0
        self.jobs: dict[str, BatchJob] = {}
        self.cancels: set[str] = set()
        self.runs: dict[str, tuple[BatchRun, asyncio.Task[None]]] = {}

    def apply(self, key: str, value: bytes | None) -> None:
        batch_id, _, what = key.partition("/")
        if value is None:  # a tombstone: of the cancel, or of the batch
            if what == CANCEL:
                self.cancels.discard(batch_id)
            else:
                self.jobs.pop(batch_id, None)
            return
        record = parse(key, value)
        if what == CANCEL and isinstance(record, BatchCancel):
            self.cancels.add(batch_id)
            if (run := self.runs.get(batch_id)) is not None:
                run[0].cancelled.set()
        elif isinstance(record, BatchJob):
            self.jobs[batch_id] = record

    async def stop(self) -> None:
        tasks = [task for _, task in self.runs.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class BatchRunner:
    def __init__(self, parts: BatchParts, member: str) -> None:
        self._parts = parts
        self._member = member
        self._held: dict[int, Partition] = {}
        self._consumer: AIOKafkaConsumer | None = None

    async def run(self) -> None:
        """Until cancelled: hold partitions, read them, run their batches."""
        topics = self._parts.topics
        consumer = make_consumer(
            self._parts.settings,
            group_id=topics.batch_runners,
            client_id=f"{self._member}-batches",
            fetch_max_wait_ms=FETCH_MS,
        )
        self._consumer = consumer
        await consumer.start()
        try:
            consumer.subscribe(
                [topics.batch_jobs],
                listener=Rebalance(revoked=self._revoked, assigned=self._assigned),
            )
            while True:
                fetched = await consumer.getmany(timeout_ms=FETCH_MS)
                for tp, records in fetched.items():
                    held = self._held.get(tp.partition)
                    if held is None:
                        continue
                    for record in records:
                        if record.key is not None:
                            self._apply(held, record.key.decode(), record.value, record.offset)
                for p, held in self._held.items():
                    if not held.read_up:
                        tp = TopicPartition(topics.batch_jobs, p)
                        held.read_up = await consumer.position(tp) >= held.end
                    if held.read_up:
                        self._start(p, held)
        finally:
            for held in self._held.values():
                await held.stop()
            self._held.clear()
            with contextlib.suppress(Exception):
                await consumer.stop()

    def _apply(self, held: Partition, key: str, value: bytes | None, offset: int) -> None:
        try:
            held.apply(key, value)
        except ValueError as exc:  # not a batch record: nothing to run, nothing lost
            log.warning("batch.bad_record", offset=offset, error=str(exc)[:200])

    def _start(self, p: int, held: Partition) -> None:
        for batch_id, job in held.jobs.items():
            if batch_id in held.runs or job.batch.status in ENDED:
                continue
            run = BatchRun(self._parts, p, job)
            if batch_id in held.cancels:
                run.cancelled.set()
            task = asyncio.create_task(self._guarded(run), name=f"batch-{batch_id}")
            held.runs[batch_id] = (run, task)

    async def _guarded(self, run: BatchRun) -> None:
        """A run that fails (the broker away too long) is started again after a pause, as
        long as this runner holds its partition."""
        while True:
            try:
                await run.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("batch.run_failed", batch_id=run.batch_id, error=repr(exc))
                await asyncio.sleep(5.0)
                run = BatchRun(run.parts, run.partition, run.job, run.cancelled)

    async def _revoked(self, parts: set[TopicPartition]) -> None:
        for tp in parts:
            held = self._held.pop(tp.partition, None)
            if held is not None:
                log.info("batch.partition_revoked", partition=tp.partition)
                await held.stop()

    async def _assigned(self, parts: set[TopicPartition]) -> None:
        consumer = self._consumer
        assert consumer is not None
        if not parts:
            return
        ends = await consumer.end_offsets(list(parts))
        await consumer.seek_to_beginning(*parts)
        for tp in parts:
            self._held[tp.partition] = Partition(ends[tp])
            log.info("batch.partition_assigned", partition=tp.partition, end=ends[tp])
