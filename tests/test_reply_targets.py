"""Which `reply_to` targets can be written, with a fake of the producer's metadata client.

The one check of ingest, the scheduler and the workers (`ReplyTargets`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokafka.cluster import ClusterMetadata

from shared.messages import ReplyTo
from shared.results import ReplyTargets, TargetProblem, Unwritable


@dataclass
class FakeCluster:
    topics: dict[str, set[int]] = field(default_factory=dict)
    unauthorized_topics: set[str] = field(default_factory=set)
    internal_topics: set[str] = field(default_factory=set)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return self.topics.get(topic)


class FakeClient:
    """The producer's cached metadata, and what each fresh look-up answers, in turn."""

    def __init__(self, cached: FakeCluster, fresh: list[FakeCluster]) -> None:
        self.cluster = cached
        self.fresh = fresh
        self.lookups = 0

    async def _metadata_update(self, cluster: ClusterMetadata, topics: list[str]) -> bool:
        """Fills `cluster` (aiokafka's ClusterMetadata) as the broker would."""
        self.lookups += 1
        answer = self.fresh[min(self.lookups, len(self.fresh)) - 1]
        known = {t: p for t, p in answer.topics.items() if t in topics}
        cluster.partitions_for_topic = known.get  # type: ignore[method-assign]
        cluster.unauthorized_topics = answer.unauthorized_topics & set(topics)
        cluster.internal_topics = answer.internal_topics & set(topics)
        return True


class FakeProducer:
    def __init__(self, client: FakeClient) -> None:
        self.client = client


def targets(client: FakeClient, **kw: float) -> ReplyTargets:
    return ReplyTargets(FakeProducer(client), timeout_s=1.0, grace_s=0.01, **kw)  # type: ignore[arg-type]


async def test_known_topics_are_answered_without_a_look_up() -> None:
    client = FakeClient(FakeCluster({"t.results": {0, 1}}), [])
    check = targets(client)
    assert await check.problem(ReplyTo(topic="t.results", partition=1)) is None
    assert await check.problem(ReplyTo(topic="t.results")) is None
    assert client.lookups == 0


async def test_a_partition_out_of_range_in_the_cache_is_looked_up_afresh() -> None:
    cached = FakeCluster({"t.results": {0, 1}})
    grown = FakeCluster({"t.results": set(range(8))})
    client = FakeClient(cached, [grown])
    assert await targets(client).problem(ReplyTo(topic="t.results", partition=7)) is None
    assert client.lookups == 1
    client = FakeClient(cached, [cached])
    verdict = await targets(client).check(ReplyTo(topic="t.results", partition=7))
    assert verdict is not None
    assert verdict.kind is Unwritable.out_of_range
    assert "partition 7 is out of range" in verdict.why


async def test_a_topic_found_by_a_look_up_is_known_for_a_while() -> None:
    client = FakeClient(FakeCluster(), [FakeCluster({"t.results": {0, 1, 2}})])
    check = targets(client)
    for partition in (None, 0, 2, 1):
        assert await check.problem(ReplyTo(topic="t.results", partition=partition)) is None
    assert client.lookups == 1
    expiring = targets(client, found_s=0.0)
    for _ in range(2):
        assert await expiring.problem(ReplyTo(topic="t.results")) is None
    assert client.lookups == 3


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


async def test_with_nothing_remembered_a_missing_topic_is_asked_about_every_time() -> None:
    client = FakeClient(FakeCluster(), [FakeCluster()])
    check = targets(client, remember_s=0.0)
    for _ in range(3):
        verdict = await check.check(ReplyTo(topic="t.nowhere"))
        assert verdict == TargetProblem(
            Unwritable.missing, "reply_to topic 't.nowhere' does not exist"
        )
    assert client.lookups == 6


async def test_a_topic_not_authorised_or_internal_is_forbidden_without_a_second_look() -> None:
    refused = FakeCluster(unauthorized_topics={"t.theirs"})
    client = FakeClient(FakeCluster(), [refused])
    verdict = await targets(client).check(ReplyTo(topic="t.theirs"))
    assert verdict == TargetProblem(
        Unwritable.forbidden, "reply_to topic 't.theirs' may not be written"
    )
    assert client.lookups == 1
    internal = FakeCluster({"__consumer_offsets": {0}}, internal_topics={"__consumer_offsets"})
    client = FakeClient(internal, [internal])
    verdict = await targets(client).check(ReplyTo(topic="__consumer_offsets"))
    assert verdict is not None
    assert verdict.kind is Unwritable.forbidden
    assert "internal to Kafka" in verdict.why


async def test_a_name_kafka_refuses_is_forbidden_without_a_look_up() -> None:
    client = FakeClient(FakeCluster(), [FakeCluster()])
    for name in (".", ".."):
        verdict = await targets(client).check(ReplyTo(topic=name))
        assert verdict == TargetProblem(
            Unwritable.forbidden, f"reply_to topic {name!r} is not a valid name"
        )
    assert client.lookups == 0


async def test_a_forgotten_topic_is_looked_up_afresh_once() -> None:
    cached = FakeCluster({"t.results": {0, 1}})
    client = FakeClient(cached, [FakeCluster()])
    check = targets(client)
    check.forget("t.results")  # a write to it failed: the cache may be stale
    verdict = await check.check(ReplyTo(topic="t.results"))
    assert verdict is not None
    assert verdict.kind is Unwritable.missing
    assert client.lookups == 2
    client.cluster = FakeCluster({"t.results": {0, 1}})
    check.forget("t.results")
    client.fresh = [cached]
    assert await check.check(ReplyTo(topic="t.results")) is None
    assert await check.check(ReplyTo(topic="t.results")) is None  # from the cache again
    assert client.lookups == 3
