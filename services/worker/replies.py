"""One run's result records on their way to `reply_to`: in order, bounded, and fenced.

Records are put in the worker's `ResultOutbox` without waiting, which produces them in
batches, in order, sending again a batch Kafka did not take (ADR 0048); a record it still
could not store after `worker_result_resend_s` fails the run with `ReplyFailed` at the next
write or at `flush` (a record still in flight after `within_s` is waited for until the
outbox settles it: it cannot be unsent, and a re-run beside it would answer twice); a run
whose worker was fenced since it started writes nothing more (`Fenced`). Either way the
caller hands the request back to be run again as the next attempt: a stream is never left
without its final record, never with a hole, and never committed silently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from services.worker.outbox import ResultOutbox
from shared.kafka import Headers, encode, key_of
from shared.messages import ReplyTo
from shared.results import Result

log = structlog.get_logger()


class Fenced(Exception):
    """The worker fenced itself since this run started: its records must not be written."""


class ReplyFailed(Exception):
    """A result record of this run could not be stored."""


class ReplyWriter:
    """Caller: one run (`RequestState`). `epoch_now()` is the worker's fence check.

    It is the outbox's `Ticket` for its records: told, one by one, whether each was stored.
    """

    def __init__(
        self,
        outbox: ResultOutbox,
        reply_to: ReplyTo,
        request_id: str,
        *,
        epoch: int,
        epoch_now: Callable[[], int],
        within_s: float,
    ) -> None:
        self._outbox = outbox
        self._reply_to = reply_to
        self._key = key_of(request_id)
        self._request_id = request_id
        self._epoch = epoch
        self._epoch_now = epoch_now
        self._within_s = within_s
        self._unsettled = 0
        self._settled = asyncio.Event()
        self._settled.set()
        self._failure: BaseException | None = None

    def check(self) -> None:
        """Raise if this run may not write any more."""
        if self._epoch_now() != self._epoch:
            raise Fenced(f"fenced: epoch {self._epoch} is over")
        if self._failure is not None:
            raise ReplyFailed(repr(self._failure)) from self._failure

    def send(self, record: Result, headers: Headers | None = None) -> None:
        """Queue `record` after every earlier one; raise if the run may not go on."""
        self.send_encoded(encode(record), headers)

    def send_encoded(self, value: bytes, headers: Headers | None = None) -> None:
        """As `send`, for a record already encoded (a chunk's `DeltaFrames.encode`)."""
        self.check()
        self._outbox.put(self._reply_to, self._key, value, headers, self)
        self._unsettled += 1
        self._settled.clear()

    async def flush(self) -> None:
        """Wait until every queued record is stored; raise `ReplyFailed` if one is not."""
        if self._unsettled:
            try:
                async with asyncio.timeout(self._within_s):
                    await self._settled.wait()
            except TimeoutError:
                # Queued records cannot be unsent: a re-run now would answer twice if they
                # are stored later (the chaos check saw `done` land after the bound, during
                # a broker node's failover). So wait until the outbox settles each one: it
                # sends a batch Kafka did not take again, in order, and fails it only after
                # `worker_result_resend_s` (outbox.py); only such a failure re-runs it.
                log.warning(
                    "results.slow",
                    request_id=self._request_id,
                    pending=self._unsettled,
                    waited_s=self._within_s,
                )
                await self._settled.wait()
        if self._failure is not None:
            raise ReplyFailed(repr(self._failure)) from self._failure

    # -- Ticket: called by the outbox ----------------------------------------------------------

    def stored(self) -> None:
        self._settle()

    def failed(self, error: BaseException) -> None:
        self._failure = self._failure or error
        self._settle()

    def _settle(self) -> None:
        self._unsettled -= 1
        if self._unsettled <= 0:
            self._settled.set()
