"""The rollouts the scheduler routes by: each model's variants and shares (shared/variants.py),
read whole from the variants topic before the scheduler takes requests, then followed.

Every scheduler replica reads the same compacted topic, so all choose alike; a restarted one
reads it again from the beginning, so it forgets nothing (ADR 0054). A record that cannot be
read is logged and skipped: dead-lettered when it arrives while following, only logged at
start-up (where every restart reads it again).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from pydantic import ValidationError

from shared.fetches import fetches, reads
from shared.messages import error_message
from shared.records import read
from shared.variants import BASELINE, ModelRollout, choose

log = structlog.get_logger()

FETCH_MS = 1000  # longest one getmany waits
LOAD_FETCH_MS = 500
MISSING_RETRY_S = 10.0  # how often a missing variants topic is looked for again


class Rollouts:
    """Each model's latest rollout, by model name.

    Caller: `RolloutReader` (`apply`) and the tier intake (`variant_of`), on one event loop;
    `tokenbus models` (`get`, `all`). Affects: only itself.
    """

    def __init__(self) -> None:
        self._by_model: dict[str, ModelRollout] = {}

    def apply(self, model: str, rollout: ModelRollout | None) -> None:
        """The model's rollout is now `rollout` (None: deleted, all to the baseline)."""
        if rollout is None:
            self._by_model.pop(model, None)
        else:
            self._by_model[model] = rollout

    def __len__(self) -> int:
        return len(self._by_model)

    def get(self, model: str) -> ModelRollout | None:
        return self._by_model.get(model)

    def all(self) -> list[ModelRollout]:
        return list(self._by_model.values())

    def variant_of(self, model: str | None, key: str) -> str | None:
        """The variant a request of `model` with conversation key `key` runs on (None: the
        baseline, and always for a request of no model or of a model without variants)."""
        rollout = None if model is None else self._by_model.get(model)
        if rollout is None or not rollout.variants:
            return None
        return choose(key, rollout.weights())


DeadLetter = Callable[[ConsumerRecord[bytes, bytes], str], Awaitable[None]]
Shares = Callable[[ModelRollout], None]


class RolloutReader:
    """Reads the variants topic into `Rollouts`. Owner of `consumer` (assigned, no group).

    Caller: the scheduler (`load` at start, then `run` as a task) and `tokenbus models`
    (`load` only).
    """

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        rollouts: Rollouts,
        admin: AIOKafkaAdminClient,
        topic: str,
        shares: Shares = lambda _: None,
    ) -> None:
        self._consumer = consumer
        self._rollouts = rollouts
        self._admin = admin
        self._topic = topic
        self._shares = shares  # told each rollout taken (the share gauges)
        self._assigned: list[TopicPartition] = []

    async def load(self) -> bool:
        """Read the topic from its beginning up to its end now; False if it does not exist.

        A deployment upgraded without `tokenbus topics create` has no variants topic: its
        models have no rollout, and `run` reads the topic once it is made.
        """
        if not await self._assign():
            log.warning("variants.topic_missing", topic=self._topic)
            return False
        consumer, tps = self._consumer, self._assigned
        started = time.monotonic()
        ends = await consumer.end_offsets(tps)
        todo = [tp for tp in tps if ends[tp] > 0]
        read = 0
        while todo:
            fetched = await consumer.getmany(*todo, timeout_ms=LOAD_FETCH_MS)
            for records in fetched.values():
                read += len(records)
                for record in records:
                    self._take(record)
            todo = [tp for tp in todo if await consumer.position(tp) < ends[tp]]
        log.info(
            "variants.loaded",
            records=read,
            models=len(self._rollouts),
            seconds=round(time.monotonic() - started, 3),
        )
        return True

    async def run(self, dead_letter: DeadLetter) -> None:
        """Take each rollout as it is written, until cancelled; dead-letter what cannot be."""
        if not self._assigned:  # `load` found no topic: read it from its start once made
            async for found in reads(self._assign, what="variants"):
                if found:
                    break
                await asyncio.sleep(MISSING_RETRY_S)
        async for fetched in fetches(self._consumer, what="variants", timeout_ms=FETCH_MS):
            for records in fetched.values():
                for record in records:
                    problem = self._take(record)
                    if problem is not None:
                        await dead_letter(record, f"invalid rollout: {problem}")

    async def _assign(self) -> bool:
        """Assign the topic's partitions, from their beginning; False if it does not exist."""
        described = await self._admin.describe_topics([self._topic])
        found = [
            TopicPartition(self._topic, p["partition"])
            for t in described
            if t.get("error_code") == 0
            for p in t["partitions"]
        ]
        if found:
            self._consumer.assign(found)
            await self._consumer.seek_to_beginning(*found)
        self._assigned = found
        return bool(found)

    def _take(self, record: ConsumerRecord[bytes, bytes]) -> str | None:
        """Apply one record; why it cannot be used, or None."""
        model = (record.key or b"").decode("utf-8", "replace")
        if not model:
            problem = "a rollout record needs its model name as key"
        elif record.value is None:
            self._rollouts.apply(model, None)
            log.info("variants.deleted", model=model)
            return None
        else:
            try:
                rollout = read(ModelRollout, record.value)
            except ValidationError as exc:
                problem = error_message(exc)
            else:
                if rollout.model == model:
                    self._rollouts.apply(model, rollout)
                    self._shares(rollout)
                    log.info(
                        "variants.rollout",
                        model=model,
                        shares={BASELINE: rollout.baseline_percent}
                        | {v.name: v.percent for v in rollout.variants},
                    )
                    return None
                problem = f"key {model!r} is not the record's model {rollout.model!r}"
        log.error("variants.invalid", offset=record.offset, error=problem)
        return problem
