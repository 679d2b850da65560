"""Which `reply_to` targets can be written, with a fake of the producer's metadata client."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import ReplyTo
from shared.results import ReplyTargets


@dataclass
class FakeCluster:
    topics: dict[str, set[int]] = field(default_factory=dict)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return self.topics.get(topic)


class FakeClient:
    """The producer's cached metadata, and what each fresh look-up answers, in turn."""

    def __init__(self, cached: FakeCluster, fresh: list[FakeCluster]) -> None:
        self.cluster = cached
        self.fresh = fresh
        self.lookups = 0

    async def _metadata_update(self, cluster: object, topics: list[str]) -> bool:
        """Fills `cluster` (aiokafka's ClusterMetadata) as the broker would."""
        self.lookups += 1
        answer = self.fresh[min(self.lookups, len(self.fresh)) - 1]
        known = {t: p for t, p in answer.topics.items() if t in topics}
        cluster.partitions_for_topic = known.get  # type: ignore[attr-defined]
        return True


class FakeProducer:
    def __init__(self, client: FakeClient) -> None:
        self.client = client


def targets(client: FakeClient) -> ReplyTargets:
    return ReplyTargets(FakeProducer(client), timeout_s=1.0, grace_s=0.01)  # type: ignore[arg-type]


async def test_known_topics_are_answered_without_a_look_up() -> None:
    client = FakeClient(FakeCluster({"t.results": {0, 1}}), [])
    check = targets(client)
    assert await check.problem(ReplyTo(topic="t.results", partition=1)) is None
    problem = await check.problem(ReplyTo(topic="t.results", partition=7))
    assert problem is not None
    assert "partition 7 is out of range" in problem
    assert client.lookups == 0


async def test_a_topic_just_created_is_found_on_the_second_look() -> None:
    client = FakeClient(FakeCluster(), [FakeCluster(), FakeCluster({"t.new": {0}})])
    assert await targets(client).problem(ReplyTo(topic="t.new")) is None
    assert client.lookups == 2


async def test_a_missing_topic_is_remembered_so_a_flood_costs_one_wait() -> None:
    client = FakeClient(FakeCluster(), [FakeCluster()])
    check = targets(client)
    for _ in range(100):
        problem = await check.problem(ReplyTo(topic="t.nowhere"))
        assert problem == "reply_to topic 't.nowhere' does not exist"
    assert client.lookups == 2  # the first look and its re-check, then remembered
