"""OpenAI's batches on the bus (ADR 0075): one record per batch on the compacted
`tokenbus.batch-jobs`, one per answered line on the compacted `tokenbus.batch-outcomes`.

- `<batch id>` on `tokenbus.batch-jobs`: the batch (`BatchJob`), written by the edge that
  creates it, then only by the runner that holds its partition (its progress, its end).
- `<batch id>/cancel` on the same partition: a cancel (`BatchCancel`), written by any edge;
  the runner reads it and stops the batch's lines, so a cancel is one record, not one per line.
- `<batch id>/<line>` on `tokenbus.batch-outcomes`, the same partition number: a line's
  outcome (`LineOutcome`), the output or error file's line for it. Keyed by line, so a line
  answered twice (a runner taken over mid-line) is one line of the files, whatever happened.

Everything a runner needs after a restart of every process is in these two topics and the
input file: the state is rebuilt by reading them, never kept elsewhere.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.producers import RenewingProducer
from shared.records import read
from shared.settings import TokenbusSettings
from shared.tables import Table
from shared.topics import Topics

Status = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
ENDED: frozenset[Status] = frozenset({"failed", "completed", "expired", "cancelled"})
Endpoint = Literal["/v1/chat/completions", "/v1/completions"]
WINDOWS = {"24h": 24 * 3600}  # OpenAI's one completion window
CANCEL = "cancel"


class RequestCounts(BaseModel):
    model_config = ConfigDict(extra="forbid")

    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    model_config = ConfigDict(extra="forbid")

    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(BaseModel):
    """OpenAI's batch object, as `client.batches.create/retrieve/list` read it."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["batch"] = "batch"
    endpoint: Endpoint
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: Literal["24h"] = "24h"
    status: Status = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class BatchJob(BaseModel):
    """The record of one batch, keyed by its id. Read through shared/records.py (ADR 0072)."""

    model_config = ConfigDict(extra="forbid")

    batch: BatchObject
    tenant: str  # its owner's name: only it may see or cancel the batch
    plan: str | None = None  # the creating key's plan, stamped on its lines' requests
    # Its input's token bound: counted against the tenant's batch_tokens_per_day.
    tokens: int | None = Field(default=None, exclude_if=lambda v: v is None)


class BatchCancel(BaseModel):
    """A cancel of the batch its key names (`<batch id>/cancel`)."""

    model_config = ConfigDict(extra="forbid")

    at: int  # Unix seconds


class LineOutcome(BaseModel):
    """One line's outcome, keyed `<batch id>/<line>`: its line of the output file (`ok`) or
    of the error file, in OpenAI's shape."""

    model_config = ConfigDict(extra="forbid")

    line: int  # the request's place in the input, from 0 (blank lines not counted)
    ok: bool
    output: dict[str, Any]  # {"id", "custom_id", "response", "error"}


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def outcome_key(batch_id: str, line: int) -> bytes:
    return f"{batch_id}/{line:06d}".encode()


def output_file_ids(batch_id: str) -> tuple[str, str]:
    """The output and error files' ids: derived from the batch's, so a runner that writes
    them again (taken over while finalizing) replaces them, never adds two."""
    suffix = batch_id.removeprefix("batch_")
    return f"file-{suffix}-output", f"file-{suffix}-errors"


def shown(job: BatchJob, cancel: BatchCancel | None) -> BatchObject:
    """The batch as a client sees it: `cancelling` from the cancel's record on, until the
    runner writes its end."""
    batch = job.batch
    if cancel is None or batch.status in ENDED or batch.status == "cancelling":
        return batch
    return batch.model_copy(update={"status": "cancelling", "cancelling_at": cancel.at})


def parse(key: str, value: bytes) -> BatchJob | BatchCancel:
    """A record of `tokenbus.batch-jobs`, by its key."""
    if key.endswith("/" + CANCEL):
        return read(BatchCancel, value)
    return read(BatchJob, value)


class BatchJobs:
    """The edge's side: create, find, list and cancel batches. The table is every batch."""

    def __init__(self, settings: TokenbusSettings, topics: Topics, producer: RenewingProducer):
        self._topic = topics.batch_jobs
        self._producer = producer
        self._table = Table(
            settings,
            topics.batch_jobs,
            topics.partitions()[topics.batch_jobs],
            parse,
            "tokenbus-batch-jobs",
        )

    async def stop(self) -> None:
        await self._table.stop()

    async def create(
        self,
        tenant: str,
        plan: str | None,
        *,
        input_file_id: str,
        endpoint: Endpoint,
        metadata: dict[str, str] | None,
        tokens: int | None = None,
    ) -> BatchObject:
        now = int(time.time())
        batch = BatchObject(
            id=new_batch_id(),
            endpoint=endpoint,
            input_file_id=input_file_id,
            created_at=now,
            expires_at=now + WINDOWS["24h"],
            metadata=metadata,
        )
        job = BatchJob(batch=batch, tenant=tenant, plan=plan, tokens=tokens)
        key = batch.id.encode()
        partition = await self._producer.partition_for(self._topic, key)
        sent = await self._producer.send_and_wait(
            self._topic, job.model_dump_json().encode(), key=key, partition=partition
        )
        self._table.put(batch.id, partition, sent.offset, job)
        return batch

    async def find(self, tenant: str, batch_id: str) -> BatchObject | None:
        """The batch `batch_id` if `tenant` owns it (another tenant's is as good as absent)."""
        await self._table.catch_up()
        job = self._table.get(batch_id)
        if not isinstance(job, BatchJob) or job.tenant != tenant:
            return None
        return shown(job, self._cancel(batch_id))

    async def owned(self, tenant: str) -> list[BatchObject]:
        """`tenant`'s batches, newest first."""
        await self._table.catch_up()
        mine = [
            shown(v, self._cancel(v.batch.id))
            for _, _, v in self._table.rows.values()
            if isinstance(v, BatchJob) and v.tenant == tenant
        ]
        return sorted(mine, key=lambda b: (b.created_at, b.id), reverse=True)

    async def spent(self, tenant: str, since: float) -> list[tuple[int, int]]:
        """(created_at, tokens) of each of `tenant`'s batches created since `since`: what its
        batch quota has counted, across every edge (the table is the bus's)."""
        await self._table.catch_up()
        return sorted(
            (v.batch.created_at, v.tokens or 0)
            for _, _, v in self._table.rows.values()
            if isinstance(v, BatchJob) and v.tenant == tenant and v.batch.created_at >= since
        )

    async def cancel(self, batch_id: str) -> None:
        """Write the batch's cancel, on its record's partition (found, so in the table)."""
        partition = self._table.rows[batch_id][0]
        key = f"{batch_id}/{CANCEL}"
        cancel = BatchCancel(at=int(time.time()))
        sent = await self._producer.send_and_wait(
            self._topic, cancel.model_dump_json().encode(), key=key.encode(), partition=partition
        )
        self._table.put(key, partition, sent.offset, cancel)

    def _cancel(self, batch_id: str) -> BatchCancel | None:
        found = self._table.get(f"{batch_id}/{CANCEL}")
        return found if isinstance(found, BatchCancel) else None
