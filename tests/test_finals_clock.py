"""Issue 38, item 4: a worker whose clock runs behind is not taken for one that never
answered. The recovery asks which requests already have a final "since" their batch was
dispatched: the batch record's timestamp is the scheduler's clock, the final's the
worker's. With the worker 5 s behind, the final looked older than its batch, the search
started after it, and an answered request ran again. On a real broker, with the final's
timestamp set as that worker's producer would set it."""

from __future__ import annotations

import time

from shared import finals
from shared.clocks import SKEW_MARGIN_S
from shared.kafka import create_topics, make_producer
from shared.messages import (
    DoneResult,
    QueuedRequest,
    ReplyTo,
    Tier,
    Timings,
    Usage,
)
from shared.results import encode, key_of
from tests.stack import new_prefix, settings_from_env

BEHIND_S = 5.0


def request_and_final(topic: str, request_id: str) -> tuple[QueuedRequest, DoneResult]:
    request = QueuedRequest(
        request_id=request_id,
        prompt="p",
        tier=Tier.interactive,
        prompt_tokens=1,
        reply_to=ReplyTo(topic=topic, partition=0),
    )
    done = DoneResult(
        request_id=request_id,
        seq=1,
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        timings=Timings(queue_ms=1.0, batch_size=1, ttft_ms=1.0, total_ms=2.0),
    )
    return request, done


async def test_a_final_from_a_worker_5_s_behind_counts_as_answered(bootstrap: str) -> None:
    assert BEHIND_S < SKEW_MARGIN_S
    settings = settings_from_env({}, KAFKA_BOOTSTRAP_SERVERS=bootstrap, topic_prefix=new_prefix())
    topic = f"{settings.topic_prefix}.replies"
    await create_topics(settings, {topic: 1})
    behind, on_time = request_and_final(topic, "behind"), request_and_final(topic, "unanswered")
    dispatched_ms = int(time.time() * 1000)  # the batch record's time, the scheduler's clock
    worker = make_producer(settings, client_id="clock-behind-worker")
    await worker.start()
    try:
        done = behind[1]
        await worker.send_and_wait(
            topic,
            encode(done),
            key=key_of(done.request_id),
            partition=0,
            timestamp_ms=dispatched_ms + 200 - int(BEHIND_S * 1000),  # written after, 5 s behind
        )
    finally:
        await worker.stop()
    found = await finals.read_back(
        settings, [behind[0], on_time[0]], dispatched_ms, 10.0, client_id="clock-behind"
    )
    # The answered one is found; the one with no final is still run again.
    assert found.answered == {"behind"}
