"""One batch's run on the runner that holds its partition (ADR 0075): from the outcomes
already on the bus, ask each line not yet answered (a bounded window at once, the runner's),
write each outcome, show progress, then write the output and error files and the end.

Run again from the start by whichever runner holds the partition next: a line answered
before is skipped (its outcome is on the bus), one in flight is asked again, and its
outcome replaces the first, so every line is in the files once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import IO

import structlog
from aiokafka import TopicPartition

from services.edge.batch_line import Asked, GaveUp, LineAsker, custom_id_of, expired
from services.edge.gateway import Gateway
from services.edge.metrics import EdgeMetrics
from shared.batch_jobs import (
    BatchError,
    BatchErrors,
    BatchJob,
    LineOutcome,
    RequestCounts,
    outcome_key,
    output_file_ids,
)
from shared.files import FileStore, StoredFile
from shared.kafka import make_consumer
from shared.messages import RequestLimits
from shared.producers import RenewingProducer
from shared.records import read
from shared.settings import TokenbusSettings
from shared.topics import Topics

log = structlog.get_logger()

FETCH_MS = 500


@dataclass
class BatchParts:
    """What every batch run of one runner shares."""

    settings: TokenbusSettings
    topics: Topics
    gateway: Gateway
    files: FileStore
    producer: RenewingProducer
    limits: RequestLimits
    window: asyncio.Semaphore  # lines in flight on this runner, all batches together
    progress_s: float  # the batch record's counts are written at most this often
    metrics: EdgeMetrics


@dataclass
class BatchRun:
    parts: BatchParts
    partition: int
    job: BatchJob
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    done: dict[int, bool] = field(default_factory=dict)  # line -> ok, as on the bus
    _shown_at: float = 0.0

    @property
    def batch_id(self) -> str:
        return self.job.batch.id

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            for state in ("total", "completed", "failed"):
                with contextlib.suppress(KeyError):  # never shown: it failed before
                    self.parts.metrics.batch_progress.remove(self.batch_id, state)

    async def _run(self) -> None:
        batch = self.job.batch
        log.info("batch.run", batch_id=batch.id, status=batch.status, partition=self.partition)
        stored = await self.parts.files.find(self.job.tenant, batch.input_file_id)
        if stored is None:
            await self._fail("invalid_file", f"the input file {batch.input_file_id} is gone")
            return
        if batch.status == "validating":
            await self._write(
                status="in_progress",
                in_progress_at=int(time.time()),
                request_counts=RequestCounts(total=stored.lines),
            )
        await self._read_outcomes()
        with tempfile.TemporaryFile() as source:
            await self._download(stored, source)
            if self.job.batch.status in ("in_progress", "validating"):
                await self._ask_lines(source)
            await self._finish(source)

    async def _download(self, stored: StoredFile, to: IO[bytes]) -> None:
        """The input, on this edge's disk while the batch runs (read from the bus once)."""
        async for chunk in self.parts.files.content(stored):
            to.write(chunk)

    async def _ask_lines(self, source: IO[bytes]) -> None:
        asker = LineAsker(self.parts.gateway, self.job, self.parts.limits)
        tasks: set[asyncio.Task[None]] = set()
        try:
            for n, raw in _lines(source):
                if n in self.done:
                    continue
                await self.parts.window.acquire()
                if self.cancelled.is_set() or self._expired():
                    self.parts.window.release()
                    break
                task = asyncio.create_task(self._ask(asker, n, raw), name=f"batch-line-{n}")
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks and not self.cancelled.is_set() and not self._expired():
                await asyncio.wait(set(tasks), timeout=1.0)
        finally:
            if tasks:
                await asyncio.shield(asker.cancel_all())
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _ask(self, asker: LineAsker, n: int, raw: bytes) -> None:
        try:
            asked = await asker.ask(raw)
            await self._outcome(n, asked)
        except GaveUp:
            pass
        finally:
            self.parts.window.release()

    async def _finish(self, source: IO[bytes]) -> None:
        if self.cancelled.is_set():
            status = "cancelled"
        elif self._expired():
            # OpenAI's way: every line not answered in the window is `batch_expired`.
            for n, raw in _lines(source):
                if n not in self.done:
                    await self._outcome(n, expired(custom_id_of(raw)))
            status = "expired"
        else:
            status = "completed"
        if self.job.batch.status != "finalizing":
            await self._write(status="finalizing", finalizing_at=int(time.time()))
        output_id, error_id = await self._write_files()
        now = int(time.time())
        stamp = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}
        await self._write(
            status=status,
            output_file_id=output_id,
            error_file_id=error_id,
            request_counts=self._counts(),
            **{stamp[status]: now},
        )
        log.info(
            "batch.ended", batch_id=self.batch_id, status=status, **self._counts().model_dump()
        )

    async def _write_files(self) -> tuple[str | None, str | None]:
        """The output and error files, each line in the input's order."""
        wanted: dict[bool, list[tuple[int, bytes]]] = {True: [], False: []}
        async for outcome in self._outcomes():
            wanted[outcome.ok].append((outcome.line, _jsonl(outcome)))
        ids = dict(zip((True, False), output_file_ids(self.batch_id), strict=True))
        names = {True: "output", False: "errors"}
        written: dict[bool, str | None] = {}
        for ok, rows in wanted.items():
            if not rows:
                written[ok] = None
                continue
            rows.sort()
            with tempfile.TemporaryFile() as out:
                for _, line in rows:
                    out.write(line)
                size = out.tell()
                file = await self.parts.files.put(
                    self.job.tenant,
                    f"{self.batch_id}_{names[ok]}.jsonl",
                    out,
                    size,
                    len(rows),
                    file_id=ids[ok],
                    purpose="batch_output",
                )
            written[ok] = file.id
        return written[True], written[False]

    async def _fail(self, code: str, message: str) -> None:
        errors = BatchErrors(data=[BatchError(code=code, message=message)])
        await self._write(status="failed", failed_at=int(time.time()), errors=errors)
        log.info("batch.failed", batch_id=self.batch_id, code=code)

    def _expired(self) -> bool:
        return time.time() >= self.job.batch.expires_at

    def _counts(self) -> RequestCounts:
        ok = sum(self.done.values())
        return RequestCounts(
            total=self.job.batch.request_counts.total, completed=ok, failed=len(self.done) - ok
        )

    async def _outcome(self, n: int, asked: Asked) -> None:
        outcome = LineOutcome(line=n, ok=asked.ok, output=asked.output)
        await self.parts.producer.send_and_wait(
            self.parts.topics.batch_outcomes,
            outcome.model_dump_json().encode(),
            key=outcome_key(self.batch_id, n),
            partition=self.partition,
        )
        self.done[n] = asked.ok
        expired_line = (asked.output.get("error") or {}).get("code") == "batch_expired"
        kind = "ok" if asked.ok else "expired" if expired_line else "failed"
        self.parts.metrics.batch_lines.labels(kind).inc()
        self._show()
        if time.monotonic() - self._shown_at >= self.parts.progress_s:
            self._shown_at = time.monotonic()
            await self._write(request_counts=self._counts())

    async def _write(self, **update: object) -> None:
        """The batch's record, with `update`: only its runner writes it (ADR 0075)."""
        batch = self.job.batch.model_copy(update=update)
        self.job = self.job.model_copy(update={"batch": batch})
        await self.parts.producer.send_and_wait(
            self.parts.topics.batch_jobs,
            self.job.model_dump_json().encode(),
            key=self.batch_id.encode(),
            partition=self.partition,
        )

    def _show(self) -> None:
        counts, gauge = self._counts(), self.parts.metrics.batch_progress
        for state, value in (
            ("total", counts.total),
            ("completed", counts.completed),
            ("failed", counts.failed),
        ):
            gauge.labels(self.batch_id, state).set(value)

    async def _read_outcomes(self) -> None:
        async for outcome in self._outcomes():
            self.done[outcome.line] = outcome.ok
        self._show()
        if self.done:
            log.info("batch.resumed", batch_id=self.batch_id, answered=len(self.done))

    async def _outcomes(self) -> AsyncIterator[LineOutcome]:
        """This batch's outcomes on the bus now, the latest of each line."""
        tp = TopicPartition(self.parts.topics.batch_outcomes, self.partition)
        prefix = f"{self.batch_id}/".encode()
        latest: dict[int, LineOutcome] = {}
        consumer = make_consumer(
            self.parts.settings,
            group_id=None,
            client_id="tokenbus-batch-outcomes",
            fetch_max_wait_ms=FETCH_MS,
        )
        await consumer.start()
        try:
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            end = (await consumer.end_offsets([tp]))[tp]
            while await consumer.position(tp) < end:
                fetched = await consumer.getmany(tp, timeout_ms=FETCH_MS)
                for record in fetched.get(tp, []):
                    if record.key is None or not record.key.startswith(prefix):
                        continue
                    if record.value is None:
                        continue
                    outcome = read(LineOutcome, record.value)
                    latest[outcome.line] = outcome
        finally:
            await consumer.stop()
        for line in sorted(latest):
            yield latest[line]


def _lines(source: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """The input's requests in order, numbered from 0 (blank lines skipped)."""
    source.seek(0)
    n = 0
    for raw in source:
        if raw.strip():
            yield n, raw
            n += 1


def _jsonl(outcome: LineOutcome) -> bytes:
    return (json.dumps(outcome.output, separators=(",", ":")) + "\n").encode()
