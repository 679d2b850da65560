"""OpenAI's files on the bus (ADR 0074): the content in chunks on `tokenbus.file-chunks`,
one record per file on `tokenbus.files` saying whose it is and where its chunks are.

A file exists once its record is written, after every chunk is acknowledged; a delete
writes tombstones for the chunks, then for the record. Every reader (each edge) keeps the
small `tokenbus.files` table and catches it up to the end before each answer, so a file
written through one edge is seen through any other at once.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import AsyncGenerator
from typing import IO, Literal

import structlog
from aiokafka import TopicPartition
from pydantic import BaseModel, ConfigDict, Field

from shared.kafka import make_consumer
from shared.producers import RenewingProducer
from shared.records import read
from shared.settings import TokenbusSettings
from shared.tables import READ_TIMEOUT_S, Table
from shared.topics import Topics

log = structlog.get_logger()

# Well below the broker's default largest record (about 1 MiB, `message.max.bytes`) and
# aiokafka's largest request (1 MiB), with room for the key and headers.
CHUNK_BYTES = 512 * 1024
FETCH_MS = 500


class FileObject(BaseModel):
    """OpenAI's file object, as `client.files.create/retrieve/list` read it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]  # a batch's input; its output or errors
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class StoredFile(BaseModel):
    """The record of one file on `tokenbus.files`, keyed by its id. Read through
    shared/records.py, which ignores fields it does not know (a later release's: ADR 0072)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: FileObject
    tenant: str
    lines: int
    sha256: str
    partition: int  # of `tokenbus.file-chunks`: all its chunks are on it
    offsets: list[int]  # each chunk's, in order
    # Its requests' token bound (prompt bound + max_tokens each): what a batch of it may use.
    tokens: int | None = Field(default=None, exclude_if=lambda v: v is None)


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def _chunk_key(file_id: str, n: int) -> bytes:
    return f"{file_id}/{n:06d}".encode()


class FileStore:
    """Writes, finds, reads and deletes files; its table is the edge's view of every file."""

    def __init__(self, settings: TokenbusSettings, topics: Topics, producer: RenewingProducer):
        self._settings = settings
        self._topics = topics
        self._producer = producer
        # id -> its record: the edge's view of every file.
        self._table = Table(
            settings, topics.files, 1, lambda _, v: read(StoredFile, v), "tokenbus-files"
        )

    async def stop(self) -> None:
        await self._table.stop()

    async def put(
        self,
        tenant: str,
        filename: str,
        source: IO[bytes],
        size: int,
        lines: int,
        *,
        file_id: str | None = None,
        purpose: Literal["batch", "batch_output"] = "batch",
        tokens: int | None = None,
    ) -> FileObject:
        """Write `source` (`size` bytes, already validated) as a file of `tenant`: a new one,
        or `file_id` (written again: the same file, replaced whole)."""
        file_id = file_id or new_file_id()
        partition = await self._producer.partition_for(self._topics.file_chunks, file_id.encode())
        digest = hashlib.sha256()
        pending = []
        source.seek(0)
        for n, chunk in enumerate(iter(lambda: source.read(CHUNK_BYTES), b"")):
            digest.update(chunk)
            pending.append(
                await self._producer.send(
                    self._topics.file_chunks, chunk, key=_chunk_key(file_id, n), partition=partition
                )
            )
        offsets = [(await sent).offset for sent in pending]
        stored = StoredFile(
            file=FileObject(
                id=file_id,
                bytes=size,
                created_at=int(time.time()),
                filename=filename,
                purpose=purpose,
            ),
            tenant=tenant,
            lines=lines,
            sha256=digest.hexdigest(),
            partition=partition,
            offsets=offsets,
            tokens=tokens,
        )
        sent = await self._producer.send(
            self._topics.files, stored.model_dump_json().encode(), key=file_id.encode(), partition=0
        )
        self._table.put(file_id, 0, (await sent).offset, stored)
        log.info("file.stored", file_id=file_id, tenant=tenant, bytes=size, lines=lines)
        return stored.file

    async def find(self, tenant: str, file_id: str) -> StoredFile | None:
        """The file `file_id` if `tenant` owns it (another tenant's is as good as absent)."""
        await self._table.catch_up()
        stored = self._table.get(file_id)
        return stored if stored is not None and stored.tenant == tenant else None

    async def owned(self, tenant: str) -> list[StoredFile]:
        """`tenant`'s files, newest first (by their records' order on the bus)."""
        await self._table.catch_up()
        mine = sorted((o, s) for _, o, s in self._table.rows.values() if s.tenant == tenant)
        return [s for _, s in reversed(mine)]

    async def content(self, stored: StoredFile) -> AsyncGenerator[bytes, None]:
        """The file's bytes, chunk by chunk, read from where its record says they are."""
        consumer = make_consumer(
            self._settings,
            group_id=None,
            client_id="tokenbus-file-reader",
            fetch_max_wait_ms=FETCH_MS,
        )
        await consumer.start()
        try:
            tp = TopicPartition(self._topics.file_chunks, stored.partition)
            consumer.assign([tp])
            wanted = list(stored.offsets)  # ascending: written in order on one partition
            digest = hashlib.sha256()
            consumer.seek(tp, wanted[0])
            deadline = time.monotonic() + READ_TIMEOUT_S  # renewed by each chunk read
            while wanted:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no chunk of {stored.file.id} within {READ_TIMEOUT_S} s")
                fetched = await consumer.getmany(tp, timeout_ms=FETCH_MS)
                for record in fetched.get(tp, []):
                    if record.offset < wanted[0]:
                        continue  # another file's chunk between this one's
                    if record.offset > wanted[0] or record.value is None:
                        raise FileGone(stored.file.id)  # compacted away: deleted meanwhile
                    digest.update(record.value)
                    wanted.pop(0)
                    deadline = time.monotonic() + READ_TIMEOUT_S
                    yield record.value
                    if not wanted:
                        break
            if digest.hexdigest() != stored.sha256:
                raise FileGone(stored.file.id)
        finally:
            await consumer.stop()

    async def delete(self, stored: StoredFile) -> None:
        """Tombstones for every chunk, then for the record: the file is gone everywhere."""
        file_id = stored.file.id
        pending = [
            await self._producer.send(
                self._topics.file_chunks,
                None,
                key=_chunk_key(file_id, n),
                partition=stored.partition,
            )
            for n in range(len(stored.offsets))
        ]
        for sent in pending:
            await sent
        await (
            await self._producer.send(self._topics.files, None, key=file_id.encode(), partition=0)
        )
        self._table.drop(file_id)
        log.info("file.deleted", file_id=file_id, tenant=stored.tenant)


class FileGone(Exception):
    """A file's chunks were not where its record says (deleted while it was read)."""
