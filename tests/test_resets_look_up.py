"""A reset's look-up of its reply_to asks again when an answer leaves the topic out.

While a node is away, a metadata answer can leave out a topic that exists (chaos seed
275703162: every reset of a recovery was skipped as "does not exist"). Pure: the metadata
call is a fake (`FakeLookUps`), the producer is never used.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pytest
from aiokafka.errors import KafkaError

from shared import resets


class FakeCluster:
    def __init__(self, topics: dict[str, set[int]]) -> None:
        self._topics = topics

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return self._topics.get(topic)


class FakeLookUps:
    """Answers in turn: each an exception to raise or the topics the answer names."""

    def __init__(self, *answers: dict[str, set[int]] | Exception) -> None:
        self.answers = list(answers)
        self.asked = 0

    async def __call__(self, producer: Any, timeout_s: float, topics: Collection[str]) -> Any:
        answer = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        if isinstance(answer, Exception):
            raise answer
        return FakeCluster(answer)


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resets, "LOOK_UP_GAP_S", 0.01)


async def test_a_topic_left_out_is_asked_for_again(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeLookUps({}, KafkaError("no broker answered"), {"replies": {0, 1}})
    monkeypatch.setattr(resets, "cluster_metadata", fake)
    assert await resets._look_up(None, {"replies"}, timeout_s=5.0) == {"replies": {0, 1}}  # type: ignore[arg-type]
    assert fake.asked == 3


async def test_a_topic_still_missing_at_the_deadline_is_reported_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeLookUps({"other": {0}})
    monkeypatch.setattr(resets, "cluster_metadata", fake)
    found = await resets._look_up(None, {"replies", "other"}, timeout_s=0.2)  # type: ignore[arg-type]
    assert found == {"other": {0}}
    assert fake.asked >= 2
