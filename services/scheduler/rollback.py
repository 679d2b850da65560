"""Automatic rollback: every second, each model's variants are judged against its baseline
(canary.py); a regressed variant's share is set to 0 on the variants topic, and the verdicts
are published on the verdicts topic for `tokenbus models` (ADR 0058).

Every scheduler replica reads the same heartbeats and scores, so all judge alike. A replica
writes a rollback only while the rollout it follows still gives the variant a share: the
first write ends the others' reason to write, and two at the same moment write the same
shares (the last one's note wins). The rollout written is applied here at once, so this
scheduler routes no new conversation to the variant while its own write travels back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
from aiokafka import AIOKafkaConsumer

from services.scheduler.canary import CanaryRule, CanaryWindows, judge, rollback
from services.scheduler.canary_metrics import CanaryMetrics, canary_metrics
from services.scheduler.scores import ScoreReader
from services.scheduler.settings import SchedulerSettings
from services.scheduler.variants import Rollouts
from shared.kafka import encode
from shared.messages import Heartbeat
from shared.process import for_life
from shared.producers import RenewingProducer
from shared.results import WRITE_ERRORS
from shared.shadows import ShadowScore
from shared.topics import Topics
from shared.variants import ModelRollout
from shared.verdicts import ModelVerdicts

log = structlog.get_logger()

WRITE_TIMEOUT_S = 10.0


class CanaryJudge:
    """Judges canaries, rolls regressed ones back, publishes the verdicts.

    Caller: the heartbeat reader (`beat`) and the scheduler (`run`, as a task), on one event
    loop; `run` also runs the scores reader (scores.py), which calls `on_score`. Affects: its
    windows; the variants topic and `rollouts` (a rollback); the verdicts topic; its metrics.
    """

    def __init__(
        self,
        settings: SchedulerSettings,
        rollouts: Rollouts,
        producer: RenewingProducer,
        scores: AIOKafkaConsumer,
        metrics: CanaryMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._rule: CanaryRule = settings.canary_rule()
        self.windows = CanaryWindows(
            self._rule.window_s, settings.canary_tenant_share, settings.canary_tenant_floor
        )
        self._rollouts = rollouts
        self._producer = producer
        self._topics = Topics(settings.topic_prefix)
        self._metrics = metrics or canary_metrics()
        self._clock = clock
        # model -> (what its last published verdicts said, when they were published)
        self._published: dict[str, tuple[object, float]] = {}
        # Shadow scores (ADR 0057), from a window back: a restart keeps its evidence.
        self._scores = ScoreReader(scores, self.on_score, rewind_s=self._rule.window_s)

    def beat(self, beat: Heartbeat) -> None:
        self.windows.beat(beat, self._clock())

    def on_score(self, score: ShadowScore) -> None:
        self.windows.score(score, self._clock())

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(for_life("scores reader", self._scores.run()))
            tg.create_task(self._judge_every())

    async def _judge_every(self) -> None:
        every = self._settings.scheduler_canary_judge_ms / 1000.0
        while True:
            await asyncio.sleep(every)
            for model in [r.model for r in self._rollouts.all()]:
                # Read now: a write for the model before may have let a newer one in.
                rollout = self._rollouts.get(model)
                if rollout is not None and rollout.variants:
                    await self.judge(rollout)

    async def judge(self, rollout: ModelRollout) -> ModelVerdicts:
        """Judge one model's variants, and act on the verdicts."""
        s, now, model = self._settings, self._clock(), rollout.model
        # 1) Judge every variant of the rollout against the baseline.
        names = [v.name for v in rollout.variants]
        verdicts = judge(self._rule, model, names, self.windows, now, s.scheduler_id)
        self._metrics.observe(verdicts)
        # 2) Roll back those regressed that still have a share.
        rolled = (
            rollback(rollout, verdicts, s.scheduler_id, now)
            if s.scheduler_canary_rollback
            else None
        )
        if rolled is not None and await self._write(self._topics.variants, model, rolled):
            self._rollouts.apply(model, rolled)
            for before, after in zip(rollout.variants, rolled.variants, strict=True):
                if after.rolled_back is not None and before.percent > 0:
                    self._metrics.rolled_back(model, after.name, after.rolled_back.checks)
                    log.warning(
                        "canary.rolled_back",
                        model=model,
                        variant=after.name,
                        percent_was=before.percent,
                        checks=",".join(after.rolled_back.checks),
                        reason=after.rolled_back.reason,
                    )
        # 3) Publish them when they change, and every few seconds regardless.
        said = [(v.variant, v.verdict, tuple(v.regressed)) for v in verdicts.variants]
        last = self._published.get(model)
        due = last is None or last[0] != said or now - last[1] >= s.scheduler_canary_publish_s
        if due and await self._write(self._topics.verdicts, model, verdicts):
            self._published[model] = (said, now)
        return verdicts

    async def _write(self, topic: str, model: str, record: ModelRollout | ModelVerdicts) -> bool:
        """Store one record keyed by its model; False (logged) if it could not be, when the
        next judgement tries again."""
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await self._producer.send_and_wait(topic, encode(record), key=model.encode())
        except WRITE_ERRORS as exc:
            log.warning("canary.write_failed", topic=topic, model=model, error=repr(exc))
            return False
        return True
