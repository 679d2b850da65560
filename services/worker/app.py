"""The worker process: takes batches, runs them on the engine, obeys cancels, heartbeats.

Wiring of `batches.py` (the batch loop), `runner.py` and `request_state.py` (a state per
run), `outbox.py`, `cancel.py`, `shadow.py`, `heartbeat.py`, `beat_producers.py` and
`liveness.py` (heartbeats, self-fencing: `fence.py`), `drain.py`, `answers.py` (errors),
`engine_health.py` (a dead or hung engine ends the process).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import structlog
from aiokafka import AIOKafkaConsumer

from services.worker.answers import Answers
from services.worker.batches import BatchLoop
from services.worker.beat_producers import BeatProducers
from services.worker.cache_writes import CacheWriter
from services.worker.cancel import CancelBook, CancelListener, control_consumer
from services.worker.cascade import Cascade
from services.worker.drain import Drain
from services.worker.engine_health import EngineWatch
from services.worker.engines.base import Engine
from services.worker.engines.factory import static_engine
from services.worker.heartbeat import Heartbeats
from services.worker.intake import BatchIntake
from services.worker.liveness import Liveness
from services.worker.load_time import load_seconds, process_started_at
from services.worker.outbox import ResultOutbox
from services.worker.outcomes import OutcomeCounts
from services.worker.request_state import RunningRequests
from services.worker.runner import RequestRunner
from services.worker.settings import WorkerSettings
from services.worker.shadow import Shadows
from services.worker.telemetry import WorkerTelemetry
from shared.health import Readiness, consumer_readiness
from shared.kafka import make_producer
from shared.process import for_life
from shared.producers import RenewingProducer
from shared.topics import Topics

log = structlog.get_logger()


class Worker:
    def __init__(
        self, settings: WorkerSettings, engine: Engine, *, drain_on_sigterm: bool = True
    ) -> None:
        self.settings = settings
        self.engine = engine
        self._drain_on_sigterm = drain_on_sigterm
        # What `/readyz` looks at, once `run` has built them.
        self._reading: AIOKafkaConsumer | None = None
        self._drain: Drain | None = None
        self._watch: EngineWatch | None = None

    async def run(self) -> None:
        s = self.settings
        intake = BatchIntake(s)
        # Renewed if an outage breaks its sequence numbers (shared/producers.py).
        producer = RenewingProducer(lambda: make_producer(s, client_id=f"worker-{s.worker_id}"))
        beats = BeatProducers(s)  # the heartbeats', one per partition (ADR 0056)
        batches = intake.consumer()
        control = control_consumer(s, Topics(s.topic_prefix))
        async with contextlib.AsyncExitStack() as stack:  # stops what started, in reverse
            for client in (producer, beats, control, batches):
                await client.start()
                stack.push_async_callback(client.stop)
            await intake.start(batches, producer)
            stack.push_async_callback(self.engine.stop)
            # Minutes for a real model; /healthz answers meanwhile, /readyz once it is loaded.
            await self.engine.start()
            self._reading = batches
            await self._serve(producer, beats, intake, batches, control)

    async def readiness(self) -> Readiness:
        """`/readyz` (shared/health.py): engine healthy, batch partition assigned, broker
        answering."""
        if self._watch is not None and (why := self._watch.sick or self._watch.problem()):
            return Readiness.not_ready(f"engine: {why}")
        if self._drain is not None and self._drain.requested.is_set():
            return Readiness.not_ready("draining")
        return await consumer_readiness([self._reading])

    async def _serve(
        self,
        producer: RenewingProducer,
        beats: BeatProducers,
        intake: BatchIntake,
        batches: AIOKafkaConsumer,
        control: AIOKafkaConsumer,
    ) -> None:
        s, engine, topics = self.settings, self.engine, Topics(self.settings.topic_prefix)
        load_s = load_seconds(time.time(), process_started_at())
        outcomes = OutcomeCounts(s.canary_tenant_share, s.canary_tenant_floor)
        telemetry, runs = WorkerTelemetry(outcomes=outcomes), RunningRequests(engine)
        drain = self._drain = Drain(s.worker_drain_timeout_s)
        liveness = Liveness.starting(s, intake, runs)  # starting up is no silence
        answers, early_cancels = Answers(producer, s), CancelBook()
        heartbeats = Heartbeats(s, beats, engine, intake, liveness, drain, telemetry, load_s=load_s)
        watch = self._watch = EngineWatch(engine, runs, s.worker_engine_stall_s)

        async def last_beat() -> None:  # the engine is sick: no slot is offered again
            heartbeats.closed = True
            await heartbeats.send_stored()

        cancels = CancelListener(engine, early_cancels, answers)
        if self._drain_on_sigterm:
            # SIGTERM drains (SIGINT still cancels at once, via run_service).
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, drain.signal)
        log.info(
            "worker.started",
            worker_id=s.worker_id,
            variant=s.worker_variant,
            engine=engine.name,
            batch_mode=s.worker_batch_mode,
            context_length=engine.context_length,
            load_s=round(load_s, 3),
        )
        async with ResultOutbox(producer, resend_s=s.worker_result_resend_s) as outbox:
            runner = RequestRunner(
                engine,
                outbox,
                runs,
                s.worker_flush_ms,
                s.worker_flush_tokens,
                s.worker_flush_first,
                telemetry=telemetry,
                epoch_now=liveness.epoch_now,
                write_timeout_s=s.worker_result_write_timeout_s,
                model=s.worker_model,
                variant=s.worker_variant,
                cache=CacheWriter(outbox, topics.cache, s.worker_model),
                cascade=Cascade.of(s, outbox, liveness.epoch_now),
                shadows=Shadows.of(s, outbox, topics),  # shadow validation (shadow.py)
            )
            loop = BatchLoop(
                intake,
                runner,
                liveness,
                answers,
                early_cancels,
                producer,
                topics,
                telemetry,
                static=static_engine(engine, s),
            )
            async with asyncio.TaskGroup() as tg:
                taker = tg.create_task(for_life("batch loop", loop.run(batches, tg)))
                others = [
                    tg.create_task(for_life("cancel listener", cancels.run(control))),
                    tg.create_task(for_life("heartbeats", heartbeats.run())),
                    tg.create_task(for_life("engine watch", watch.run(last_beat))),
                ]
                await drain.requested.wait()
                taker.cancel()
                await heartbeats.send()  # tell schedulers: no free slots here
                await drain.run(
                    loop.tasks,
                    lambda: frozenset(runs.ids()),
                    runs.hand_back,
                    at_once=lambda rid: (
                        (st := runs.get(rid)) is not None and runner.continuable(st.request)
                    ),
                )
                for task in others:
                    task.cancel()
                await heartbeats.leave()  # gone, not dead: no schedule waits for its silence
        log.info("worker.drained", worker_id=s.worker_id)
