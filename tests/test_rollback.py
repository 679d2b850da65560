"""The canary judge's actions (services/scheduler/rollback.py): a regressed canary with a
share is written back at 0 % once, and routed away from at once; verdicts are published when
they change and every few seconds; a write that fails is tried again at the next judgement.
With a fake producer and a given clock (the judgement itself: tests/test_canary.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.scheduler.canary_metrics import CanaryMetrics
from services.scheduler.rollback import CanaryJudge
from services.scheduler.settings import SchedulerSettings
from services.scheduler.variants import Rollouts
from shared.shadows import ShadowScore
from shared.topics import Topics
from shared.variants import ModelRollout, Variant
from shared.verdicts import ModelVerdicts

T0 = 1_000_000.0
TOPICS = Topics("p")


class FakeProducer:
    """Keeps what it is asked to store, by topic; fails every send while `down`."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes | None]] = []
        self.down = False

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        if self.down:
            raise TimeoutError("broker away")
        self.sent.append((topic, value, key))

    def on(self, topic: str) -> list[bytes]:
        return [value for t, value, _ in self.sent if t == topic]


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def judge_with(producer: FakeProducer, clock: Clock) -> tuple[CanaryJudge, Rollouts]:
    settings = SchedulerSettings(
        topic_prefix="p",
        scheduler_id="s1",
        scheduler_canary_min_scores=5,
        scheduler_canary_publish_s=5.0,
    )
    rollouts = Rollouts()
    rollouts.apply("m", ModelRollout(model="m", variants=[Variant(name="c", percent=50)]))
    metrics = CanaryMetrics.build(CollectorRegistry())
    judge = CanaryJudge(settings, rollouts, producer, None, metrics, clock)  # type: ignore[arg-type]
    return judge, rollouts


def wrong_answers(judge: CanaryJudge, clock: Clock, n: int = 5) -> None:
    for i in range(n):
        judge.on_score(
            ShadowScore(
                model="m",
                variant="c",
                gold="baseline",
                request_id=f"r{i}",
                exact=False,
                f1=0.0,
                rouge_l=0.0,
                quality=0.0,
                deterministic=True,
                scored_at=clock.now,
            )
        )


def rollout_of(rollouts: Rollouts) -> ModelRollout:
    found = rollouts.get("m")
    assert found is not None
    return found


async def test_a_regressed_canary_is_written_back_at_zero_once() -> None:
    producer, clock = FakeProducer(), Clock()
    judge, rollouts = judge_with(producer, clock)
    wrong_answers(judge, clock)
    await judge.judge(rollout_of(rollouts))
    [written] = producer.on(TOPICS.variants)
    rolled = ModelRollout.model_validate_json(written)
    assert rolled.variants[0].percent == 0.0
    assert rolled.variants[0].rolled_back is not None
    assert rollout_of(rollouts) == rolled  # routed by at once, before it is read back
    assert (TOPICS.variants, written, b"m") in producer.sent
    clock.now += 1
    await judge.judge(rollout_of(rollouts))
    assert len(producer.on(TOPICS.variants)) == 1  # no share left: nothing more to write
    metric = judge._metrics.rollbacks.labels("m", "c", "quality")
    assert metric._value.get() == 1


async def test_verdicts_are_published_on_a_change_and_every_few_seconds() -> None:
    producer, clock = FakeProducer(), Clock()
    judge, rollouts = judge_with(producer, clock)
    await judge.judge(rollout_of(rollouts))
    first = ModelVerdicts.model_validate_json(producer.on(TOPICS.verdicts)[0])
    assert [v.verdict for v in first.variants] == ["reference", "too_few"]
    clock.now += 1
    await judge.judge(rollout_of(rollouts))
    assert len(producer.on(TOPICS.verdicts)) == 1  # unchanged, published a second ago
    wrong_answers(judge, clock)
    await judge.judge(rollout_of(rollouts))
    assert len(producer.on(TOPICS.verdicts)) == 2  # changed: regressed
    clock.now += 5
    await judge.judge(rollout_of(rollouts))
    assert len(producer.on(TOPICS.verdicts)) == 3  # unchanged, but 5 s on


async def test_a_rollback_that_cannot_be_stored_is_tried_again() -> None:
    producer, clock = FakeProducer(), Clock()
    judge, rollouts = judge_with(producer, clock)
    wrong_answers(judge, clock)
    producer.down = True
    canary = (await judge.judge(rollout_of(rollouts))).of("c")
    assert canary is not None
    assert canary.verdict == "regressed"
    assert rollout_of(rollouts).variants[0].percent == 50  # not applied: not stored
    producer.down = False
    clock.now += 1
    await judge.judge(rollout_of(rollouts))
    assert len(producer.on(TOPICS.variants)) == 1
    assert rollout_of(rollouts).variants[0].percent == 0.0
