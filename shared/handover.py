"""Who re-issues a worker's unfinished batches: one transaction, under the worker's own id.

A worker's unfinished work is the range of its batch partition from its group's committed
offset to the end. Two parties may find that range orphaned and re-issue it (each request
back on its tier topic as `attempt + 1`): the scheduler's recovery, when it declares the
worker dead, and the worker's next process under the same id, when it starts. Both did
before, each on its own, and a recovery whose last "still dead?" check ran just before the
new process's first heartbeat re-issued the range the new process was replaying: two
workers ran the same attempt and wrote two chunkings into one stream (docs/reliability.md,
finding 0; ADR 0021).

The rule now, for both: start a transactional producer under `transactional_id(worker)`
first (Kafka aborts any other party's transaction still open under that id, and lets the
new producer start only once a committing one is complete), then read the committed
offset, then commit the hand-backs and the move of the committed offset to the range's
end in one transaction. Whoever commits first owns the range; the other reads the moved
offset and finds nothing; a party fenced before its commit wrote no hand-back (the tier
readers read committed records only) and starts over. Exactly one of them re-issues each
batch, and Kafka, not a process's memory, decides which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition

from shared.kafka import encode, key_of
from shared.messages import QueuedRequest
from shared.topics import Topics

log = structlog.get_logger()

# A group coordinator that is moving (its broker node was killed) has been seen to answer
# "no committed offset" for a group that has one (in a chaos run a restarted worker took
# that for a new id, started at the log end, and requests were never run: ADR 0021,
# docs/reliability.md finding 10). "None"
# is believed only when this many reads, CONFIRM_GAP_S apart, agree.
CONFIRM_READS = 3
CONFIRM_GAP_S = 1.0


def transactional_id(topics: Topics, worker_id: str) -> str:
    """The transactional id every party re-issuing `worker_id`'s batches uses.

    The worker's group name: transactional ids are their own namespace in Kafka (and their
    own ACL resource), and one name per worker keeps a worker's start from fencing the
    recovery of another.
    """
    return topics.worker_group(worker_id)


async def committed_offset(
    read: Callable[[], Awaitable[int | None]],
    *,
    reads: int = CONFIRM_READS,
    gap_s: float = CONFIRM_GAP_S,
) -> int | None:
    """The committed offset `read()` returns; None only if `reads` reads in a row say none.

    Costs `(reads - 1) * gap_s` only when there is no committed offset (a new worker id).
    """
    for attempt in range(reads):
        offset = await read()
        if offset is not None and offset >= 0:
            if attempt:
                log.warning("committed_offset.found_on_reread", reads=attempt + 1, offset=offset)
            return offset
        if attempt + 1 < reads:
            await asyncio.sleep(gap_s)
    return None


def distinct(requests: Iterable[QueuedRequest]) -> list[QueuedRequest]:
    """Each (request_id, attempt) once, in order (a batch sent twice by a retried produce)."""
    seen: set[tuple[str, int]] = set()
    out: list[QueuedRequest] = []
    for request in requests:
        key = (request.request_id, request.attempt)
        if key not in seen:
            seen.add(key)
            out.append(request)
    return out


async def commit_hand_backs(
    producer: AIOKafkaProducer,
    topics: Topics,
    requests: Iterable[QueuedRequest],
    offsets: Mapping[TopicPartition, int],
    group: str,
    sent: Mapping[str, str] | None = None,
) -> None:
    """In one transaction: each request back on its tier topic as the next attempt, and
    `group`'s committed offsets moved to `offsets`. Raises if the producer was fenced.

    `sent`: request_id -> the text its attempt sent (`shared/finals.py`), which the next
    attempt continues."""
    sent = sent or {}
    async with producer.transaction():
        for request in requests:
            again = request.next_attempt(sent.get(request.request_id))
            await producer.send(
                topics.tier(request.tier), encode(again), key=key_of(again.request_id)
            )
        await producer.send_offsets_to_transaction(dict(offsets), group)
