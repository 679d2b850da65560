"""The worker's heartbeats: what it can take, what it holds; soon after a slot frees.

Each beat goes to every partition of `tokenbus.workers`, one copy each, spread over the
broker nodes, each by a producer of its own (`beat_producers.py`, ADR 0056): a node that
is away holds back only its own partition, and the beat is proof of life as soon as any
partition stores it. A partition whose last beat is still on its way gets none more until
it is (beats never pile up behind a node away).

Each partition's beat is queued and awaited in a task of its own, never by the loop: a
producer's `send` itself can wait, for its metadata, on a node that hangs (up to the
request timeout, 3 s). Awaited in turn, one such send held back every partition's beat, and
a worker in its first second, whose producers had not yet sent, was declared dead when a
node hung (found in stop 18; `tests/test_cluster.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from services.worker.beat_producers import BeatProducers
from services.worker.drain import Drain
from services.worker.engines.base import Capacity, Engine
from services.worker.intake import BatchIntake
from services.worker.liveness import Liveness
from services.worker.settings import WorkerSettings
from services.worker.telemetry import WorkerTelemetry
from shared.kafka import encode
from shared.messages import LEAVING_HEADER, Capabilities, Heartbeat
from shared.producers import RenewingProducer
from shared.results import WRITE_ERRORS
from shared.topics import Topics

log = structlog.get_logger()

# After a slot frees, the next heartbeat goes out this soon (not sooner), so schedulers
# refill the slot without waiting for the regular interval. A static worker whose batch
# has just ended sends at once (`Heartbeats._min_gap`).
HEARTBEAT_MIN_GAP_S = 0.05
# A partition's beat still unsettled after this long is given up and no longer holds the
# next one back (a renewed producer may never settle its predecessor's futures).
UNSETTLED_AT_MOST_S = 10.0


def free_slots(cap: Capacity, held: int, *, one_batch_at_a_time: bool) -> int:
    """The free slots a heartbeat advertises.

    Requests taken in but not yet in the engine count as busy too. A static worker (one
    batch record per engine call) takes one batch at a time: all its slots while nothing
    is held or running, none otherwise.
    """
    if one_batch_at_a_time:
        idle = held == 0 and cap.running == 0 and cap.queued == 0
        return cap.total_slots if idle else 0
    return min(cap.free_slots, max(0, cap.total_slots - held))


class Heartbeats:
    """Caller: the worker (`run` as a task, `send` once more when a drain starts)."""

    def __init__(
        self,
        settings: WorkerSettings,
        producers: BeatProducers,
        engine: Engine,
        intake: BatchIntake,
        liveness: Liveness,
        drain: Drain,
        telemetry: WorkerTelemetry,
        load_s: float | None = None,
    ) -> None:
        self._settings = settings
        self._topic = Topics(settings.topic_prefix).workers
        self._key = settings.worker_id.encode()
        self._producers = producers
        self._engine = engine
        self._intake = intake
        self._liveness = liveness
        self._drain = drain
        self.closed = False  # set when the engine is sick: no slot is offered again
        self._leaving = False  # the last beat of a drained worker (`leave`)
        self._telemetry = telemetry
        self._load_s = load_s  # process start to ready (load_time.py): in every beat
        # By partition: the newest beat's delivery there and its monotonic send time.
        self._unsettled: dict[int, tuple[asyncio.Task[None], float]] = {}

    async def run(self) -> None:
        interval = self._settings.worker_heartbeat_ms / 1000.0
        freed = self._intake.freed
        while True:
            freed.clear()
            await self.send()
            await self._min_gap(freed)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval - HEARTBEAT_MIN_GAP_S):
                    await freed.wait()

    async def _min_gap(self, freed: asyncio.Event) -> None:
        """The least time between beats, cut short when a static worker's batch has ended.

        Its rows finish one by one, each a reason for a beat, but its slots all come free
        only with the last: that beat goes out at once, since until the schedulers hear it
        the worker idles. A freed slot seen meanwhile leaves `freed` set (a beat follows).
        """
        if self._settings.worker_batch_mode != "static":
            await asyncio.sleep(HEARTBEAT_MIN_GAP_S)
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + HEARTBEAT_MIN_GAP_S
        seen = False
        while (left := until - loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await freed.wait()
            if freed.is_set():
                seen = True
                freed.clear()
                if self._free_now() > 0:
                    break
        if seen:
            freed.set()

    def _free_now(self) -> int:
        cap = self._engine.capacity()
        static = self._settings.worker_batch_mode == "static"
        free = free_slots(cap, len(self._intake), one_batch_at_a_time=static)
        return 0 if self._drain.requested.is_set() or self.closed else free

    async def send(self) -> None:
        """Send a beat to every partition not still busy with the last one; waits for none."""
        self._liveness.epoch_now()  # after a pause, fence before telling anyone we are alive
        value = encode(self._beat())
        headers = [(LEAVING_HEADER, b"1")] if self._leaving else None
        sent_at = time.monotonic()
        for partition, producer in self._producers.by_partition.items():
            if self._held_back(partition, sent_at):
                continue  # its node is slow or away: the other partitions carry this beat
            delivery = asyncio.create_task(
                self._deliver(partition, producer, value, sent_at, headers)
            )
            self._unsettled[partition] = (delivery, sent_at)

    async def leave(self) -> None:
        """The drained worker's last beat (with `LEAVING_HEADER`), waited for: the
        schedulers see it go, not die. Called once `run` is cancelled. The beats still on
        their way are waited for first (each for at most `UNSETTLED_AT_MOST_S`): a partition
        holds back a beat behind an unsettled one, and the leaving beat must go to every
        partition (`make upgrade-check` saw it go nowhere, and the worker taken for dead)."""
        self._leaving = True
        pending = [delivery for delivery, _ in self._unsettled.values()]
        if pending:
            await asyncio.wait(pending)
        await self.send_stored()

    async def send_stored(self) -> None:
        """Send a beat and wait until each partition's is stored (or given up)."""
        await self.send()
        deliveries = [delivery for delivery, _ in self._unsettled.values()]
        if deliveries:
            await asyncio.wait(deliveries)

    async def _deliver(
        self,
        partition: int,
        producer: RenewingProducer,
        value: bytes,
        sent_at: float,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Queue one beat on `partition` and wait until it is stored, for at most
        `UNSETTLED_AT_MOST_S`; a stored beat is proof of life (`Liveness.stored`)."""
        try:
            async with asyncio.timeout(UNSETTLED_AT_MOST_S):
                try:
                    future = await producer.send(
                        self._topic, value, key=self._key, partition=partition, headers=headers
                    )
                except WRITE_ERRORS as exc:
                    log.warning("heartbeat.send_failed", partition=partition, error=repr(exc))
                    return
                await future
        except Exception:  # late, lost with its node, or its producer stopped: worth nothing
            return
        self._liveness.stored(sent_at)

    def _held_back(self, partition: int, now: float) -> bool:
        """Whether the last beat sent to `partition` is still on its way (and not too old)."""
        unsettled = self._unsettled.get(partition)
        if unsettled is None:
            return False
        delivery, sent_at = unsettled
        return not delivery.done() and now - sent_at < UNSETTLED_AT_MOST_S

    def _beat(self) -> Heartbeat:
        s, engine, intake = self._settings, self._engine, self._intake
        cap = engine.capacity()
        self._telemetry.observe_capacity(cap.running, cap.total_slots, cap.prefix_cache_hit_rate)
        self._telemetry.observe_engine_cpu(engine.cpu_seconds)
        return Heartbeat(
            worker_id=s.worker_id,
            model=s.worker_model,
            variant=s.worker_variant,
            total_slots=cap.total_slots,
            # A draining worker takes nothing new.
            free_slots=self._free_now(),
            running=cap.running,
            queued_tokens=cap.queued_tokens,
            utilisation=min(1.0, cap.utilisation),
            batch_partition=intake.tp.partition,
            batches_consumed=intake.consumed,
            held=intake.held(),
            interval_ms=s.worker_heartbeat_ms,
            started_at=intake.started_at,
            batch_mode=s.worker_batch_mode,
            prefix_cache_hit_rate=cap.prefix_cache_hit_rate,
            queued=cap.queued,
            kv_cache_usage=cap.kv_cache_usage,
            max_model_len=engine.context_length,
            capabilities=Capabilities(engine=engine.name, sampling=engine.sampling_fields),
            load_s=self._load_s,
            outcomes=self._telemetry.outcomes.snapshot(),
        )
