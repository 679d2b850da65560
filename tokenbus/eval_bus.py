"""How `tokenbus eval` runs a set through the bus: each item once per variant, as a pinned
request on the requests topic (a trusted writer, as any Kafka application), its answer read
back from a reply topic of the command's own, with a bound on the requests in flight.

`Stream` (pure) assembles one request's result records into its answer the way every reader
of results does: the latest attempt's deltas in order, a reset dropping an earlier attempt's,
the first final ending it (ADR 0055). `EvalBus` owns the Kafka clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from pydantic import TypeAdapter, ValidationError

from shared.kafka import create_topics, encode, key_of, make_consumer, make_producer
from shared.messages import (
    DeltaResult,
    DoneResult,
    ErrorResult,
    ReplyTo,
    RequestRecord,
    ResetResult,
    ResultRecord,
    Tier,
)
from shared.records import read
from shared.settings import TokenbusSettings
from shared.topics import Topics
from shared.variants import BASELINE
from tokenbus.eval_report import Answer
from tokenbus.eval_set import EvalItem

log = structlog.get_logger()

_results: TypeAdapter[ResultRecord] = TypeAdapter(ResultRecord)

REPLY_APP = "tokenbus-eval"  # its reply topic: `Topics.app_replies(REPLY_APP)`
REPLY_PARTITIONS = 4
FETCH_MS = 200

Progress = Callable[[str, str, Answer], None]


@dataclass
class Stream:
    """One request's result records as they are read, until its first final."""

    attempt: int = 0
    chunks: dict[int, str] = field(default_factory=dict)  # seq -> text, latest attempt
    final: DoneResult | ErrorResult | None = None

    def take(self, record: ResultRecord) -> bool:
        """Take one record; True when it ends the stream (its first final)."""
        if self.final is not None or record.attempt < self.attempt:
            return False  # after the answer, or of an attempt superseded already
        if record.attempt > self.attempt:
            self.attempt, self.chunks = record.attempt, {}
        if isinstance(record, ResetResult):
            return False
        if isinstance(record, DeltaResult):
            self.chunks.setdefault(record.seq, record.text)
            return False
        self.final = record
        return True

    def answer(self, seconds: float) -> Answer:
        final = self.final
        if isinstance(final, ErrorResult):
            return Answer(error=f"{final.code}: {final.message}", seconds=seconds)
        assert final is not None, "only an ended stream has an answer"
        return Answer(
            text="".join(self.chunks[seq] for seq in sorted(self.chunks)),
            answered_by=final.variant or BASELINE,
            finish_reason=final.finish_reason,
            completion_tokens=final.usage.completion_tokens,
            seconds=seconds,
        )


@dataclass
class _Pending:
    stream: Stream
    ended: asyncio.Future[None]


class EvalBus:
    """Sends requests and hands each its answer. Owner of `producer` and `consumer` (the
    consumer assigned to the reply topic's partitions, at their ends, before anything is
    sent).

    Caller: `run_set` (`ask` from many tasks, `read` as one task), on one event loop.
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        consumer: AIOKafkaConsumer,
        requests_topic: str,
        reply_to: ReplyTo,
    ) -> None:
        self._producer = producer
        self._consumer = consumer
        self._requests = requests_topic
        self.reply_to = reply_to
        self._pending: dict[str, _Pending] = {}

    async def ask(self, record: RequestRecord, wait_s: float) -> Answer:
        """Send one request and wait up to `wait_s` for its answer; a timeout is an answer
        with the error that says so."""
        started = time.monotonic()
        pending = _Pending(Stream(), asyncio.get_running_loop().create_future())
        self._pending[record.request_id] = pending
        try:
            await self._producer.send_and_wait(
                self._requests, encode(record), key=key_of(record.request_id)
            )
            try:
                await asyncio.wait_for(asyncio.shield(pending.ended), wait_s)
            except TimeoutError:
                return Answer(
                    error=f"timeout: no answer within {wait_s:g} s",
                    seconds=time.monotonic() - started,
                )
            return pending.stream.answer(time.monotonic() - started)
        finally:
            del self._pending[record.request_id]

    async def read(self) -> None:
        """Hand each result record to its request's stream, until cancelled."""
        while True:
            fetched = await self._consumer.getmany(timeout_ms=FETCH_MS)
            for records in fetched.values():
                for record in records:
                    pending = self._pending.get((record.key or b"").decode("utf-8", "replace"))
                    if pending is None:
                        continue  # another run's, or one that timed out
                    try:
                        result = read(_results, record.value or b"")
                    except ValidationError as exc:
                        log.warning("eval.result_invalid", offset=record.offset, error=str(exc))
                        continue
                    if pending.stream.take(result) and not pending.ended.done():
                        pending.ended.set_result(None)


@dataclass(frozen=True)
class RunConfig:
    """How a set is run: on which model, the most requests in flight, each one's deadline."""

    model: str
    variants: Sequence[str]
    concurrency: int
    timeout_s: float
    tier: Tier = Tier.background


async def run_set(
    settings: TokenbusSettings, items: Sequence[EvalItem], config: RunConfig, progress: Progress
) -> dict[tuple[str, str], Answer]:
    """Every item's answer on every variant, by (item id, variant)."""
    topics = Topics(settings.topic_prefix)
    reply_topic = topics.app_replies(REPLY_APP)
    await create_topics(settings, {reply_topic: REPLY_PARTITIONS})
    run = f"eval-{uuid.uuid4().hex[:12]}"  # request ids: `{run}-{item number}-{variant}`
    async with contextlib.AsyncExitStack() as stack:
        producer = make_producer(settings, client_id="tokenbus-eval")
        await producer.start()
        stack.push_async_callback(producer.stop)
        consumer = make_consumer(settings, group_id=None, client_id="tokenbus-eval")
        await consumer.start()
        stack.push_async_callback(consumer.stop)
        tps = [TopicPartition(reply_topic, p) for p in range(REPLY_PARTITIONS)]
        consumer.assign(tps)
        for tp, end in (await consumer.end_offsets(tps)).items():
            consumer.seek(tp, end)  # now: answers come only after this
        bus = EvalBus(producer, consumer, topics.requests, ReplyTo(topic=reply_topic))
        answers = await _run(bus, run, items, config, progress)
    return answers


async def _run(
    bus: EvalBus, run: str, items: Sequence[EvalItem], config: RunConfig, progress: Progress
) -> dict[tuple[str, str], Answer]:
    limit = asyncio.Semaphore(config.concurrency)
    answers: dict[tuple[str, str], Answer] = {}
    deadline_ms = int(config.timeout_s * 1000)

    async def one(n: int, item: EvalItem, variant: str) -> None:
        record = item.request(
            request_id=f"{run}-{n}-{variant}",
            model=config.model,
            variant=variant,
            reply_to=bus.reply_to,
            deadline_ms=deadline_ms,
            tier=config.tier,
        )
        async with limit:
            # The deadline lets a scheduler drop what waits too long; the wait bounds the rest.
            answer = await bus.ask(record, config.timeout_s)
        answers[(item.id, variant)] = answer
        progress(item.id, variant, answer)

    async with asyncio.TaskGroup() as tg:
        reader = tg.create_task(bus.read())  # a Kafka error there ends the run
        # Item by item, each on every variant: no variant's answers all come last.
        asked = [
            tg.create_task(one(n, item, variant))
            for n, item in enumerate(items)
            for variant in config.variants
        ]
        await asyncio.gather(*asked)
        reader.cancel()
    return answers
