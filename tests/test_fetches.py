"""The service kit's retry pieces (shared/retry.py `Backoff`, shared/fetches.py `reads`).

Pure logic with a fake read: the loops built on them run against a real broker in the
ingest, scheduler and worker tests.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import KafkaConnectionError

from shared.fetches import reads
from shared.retry import Backoff, retrying


def test_backoff_doubles_to_its_cap_and_starts_over_when_reset() -> None:
    backoff = Backoff(0.1, 0.5)
    assert [backoff.next() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.reset()
    assert backoff.next() == 0.1


@pytest.mark.parametrize(("first", "longest"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)])
def test_backoff_refuses_waits_out_of_order(first: float, longest: float) -> None:
    with pytest.raises(ValueError, match="first_s"):
        Backoff(first, longest)


async def test_reads_outlives_kafka_errors_and_yields_each_read() -> None:
    outcomes: list[BaseException | int] = [KafkaConnectionError(), 1, KafkaConnectionError(), 2]

    async def fake_read() -> int:
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    got = []
    async for value in reads(fake_read, what="fake"):
        got.append(value)
        if len(got) == 2:
            break
    assert got == [1, 2]
    assert outcomes == []


async def test_reads_lets_other_errors_through() -> None:
    async def broken() -> int:
        raise RuntimeError("not Kafka's")

    with pytest.raises(RuntimeError, match="not Kafka's"):
        async for _ in reads(broken, what="fake"):
            pass


async def test_retrying_cuts_a_try_that_hangs_and_tries_again() -> None:
    """`attempt_s`: a read that would wait for good (an end it cannot reach) starts over."""
    tries: list[int] = []

    async def attempt() -> str:
        tries.append(len(tries))
        if len(tries) == 1:
            await asyncio.Event().wait()  # never set: this try hangs
        return "read"

    got = await retrying(
        attempt,
        within_s=None,
        what="test",
        retry_on=(KafkaConnectionError,),
        backoff=Backoff(0.01, 0.01),
        attempt_s=0.05,
    )
    assert got == "read"
    assert tries == [0, 1]
