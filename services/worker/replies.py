"""One run's result records on their way to `reply_to`: in order, bounded, and fenced.

A record that cannot be queued (no metadata, a full buffer) is retried with backoff for
up to `within_s`; one that Kafka did not store fails the run with `ReplyFailed` at the next
write or at `flush` (a record still in flight after `within_s` is waited for until the
producer stores or fails it: it cannot be unsent, and a re-run beside it would answer
twice); a run whose worker was fenced since it started writes nothing more
(`Fenced`). Either way the caller hands the request back to be run again as the next
attempt: a stream is never left without its final record, and never committed silently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from shared.kafka import Headers
from shared.messages import ReplyTo
from shared.results import WRITE_ERRORS, Result, send_result
from shared.retry import retrying

log = structlog.get_logger()


class Fenced(Exception):
    """The worker fenced itself since this run started: its records must not be written."""


class ReplyFailed(Exception):
    """A result record of this run could not be stored."""


class ReplyWriter:
    """Caller: one `RequestRunner.run`. `epoch_now()` is the worker's fence check."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        reply_to: ReplyTo,
        *,
        epoch: int,
        epoch_now: Callable[[], int],
        within_s: float,
    ) -> None:
        self._producer = producer
        self._reply_to = reply_to
        self._epoch = epoch
        self._epoch_now = epoch_now
        self._within_s = within_s
        self._pending: list[asyncio.Future[RecordMetadata]] = []
        self._failure: BaseException | None = None
        self._request_id = ""  # of the records written, for the logs

    def check(self) -> None:
        """Raise if this run may not write any more."""
        if self._epoch_now() != self._epoch:
            raise Fenced(f"fenced: epoch {self._epoch} is over")
        if self._failure is not None:
            raise ReplyFailed(repr(self._failure)) from self._failure

    async def send(self, record: Result, headers: Headers | None = None) -> None:
        """Queue `record` after every earlier one; raise if the run may not go on."""
        self.check()
        future = await retrying(
            lambda: send_result(self._producer, self._reply_to, record, headers),
            within_s=self._within_s,
            what="result",
            retry_on=WRITE_ERRORS,
            request_id=record.request_id,
        )
        future.add_done_callback(self._stored)
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(future)
        self._request_id = record.request_id

    async def flush(self) -> None:
        """Wait until every queued record is stored; raise `ReplyFailed` if one is not."""
        pending = [f for f in self._pending if not f.done()]
        if pending:
            # Not wait_for: cancelling the producer's futures would not unsend anything.
            await asyncio.wait(pending, timeout=self._within_s)
            if any(not f.done() for f in pending):
                # Queued records cannot be unsent: a re-run now would answer twice if they
                # are stored later (the chaos check saw `done` land after the bound, during
                # a broker node's failover). So wait until the producer settles each one: the
                # idempotent producer retries until stored, and fails a batch only when its
                # partition has no leader past the request timeout or the producer is
                # renewed (shared/producers.py); only such a failure re-runs the request.
                log.warning(
                    "results.slow",
                    request_id=self._request_id,
                    pending=sum(1 for f in pending if not f.done()),
                    waited_s=self._within_s,
                )
                await asyncio.wait(pending)
        if self._failure is not None:
            raise ReplyFailed(repr(self._failure)) from self._failure

    def _stored(self, future: asyncio.Future[RecordMetadata]) -> None:
        if future.cancelled():
            self._failure = self._failure or asyncio.CancelledError()
        elif (exc := future.exception()) is not None:
            self._failure = self._failure or exc
