"""OpenAI's Files API for batch input (issue 39, ADR 0074): `POST /v1/files`, `GET
/v1/files`, `GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.

An upload streams to a temporary file on the edge's disk (Starlette's multipart parser);
every line is checked as its endpoint would check it (batch_lines.py) and only a file that
passes whole is stored, on the bus (shared/files.py). A file is its tenant's: another
tenant's key gets 404, as for a file that does not exist.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import IO, Any, Protocol

import structlog
from aiokafka.errors import KafkaError
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from services.edge.keys import Principal
from services.edge.openai.batch_lines import check_lines
from services.edge.openai.errors import (
    HttpError,
    http_error,
    invalid,
    too_large,
    too_slow,
)
from services.edge.openai.routes import Streams, error_response
from shared.files import FileGone, FileStore, StoredFile
from shared.messages import ErrorCode

log = structlog.get_logger()

PURPOSES = ("batch",)  # what files are for here: a batch's input
UPLOAD_RETRY_AFTER_MS = 2000
# The form's other fields (`purpose`) are a few bytes.
MAX_FIELD_BYTES = 1024
# What a body may hold beside the file: the form's boundaries, part headers and fields.
FORM_SLACK_BYTES = 64 * 1024


class _TooLarge(Exception):
    pass


class FilesApi:
    """The handlers; `store()` is None until the edge has reached Kafka."""

    def __init__(
        self,
        streams: Streams,
        store: Callable[[], FileStore | None],
        *,
        max_bytes: int,  # TOKENBUS_EDGE_FILE_MAX_BYTES
        uploads: int,  # TOKENBUS_EDGE_FILE_UPLOADS
        upload_s: float,  # TOKENBUS_EDGE_FILE_UPLOAD_S
    ) -> None:
        self._streams = streams
        self._store = store
        self._max_bytes = max_bytes
        self._uploads = asyncio.Semaphore(uploads)
        self._upload_s = upload_s

    async def upload(self, request: Request) -> Response:
        principal = self._streams.authenticate(request.headers)
        if isinstance(principal, HttpError):
            return error_response(principal)
        store = self._store()
        if store is None:
            return error_response(unavailable())
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_bytes + FORM_SLACK_BYTES:
            return error_response(too_large(self._max_bytes))
        if self._uploads.locked():
            return error_response(
                http_error(
                    ErrorCode.overloaded,
                    "the edge is taking as many uploads as it may; try again",
                    retry_after_ms=UPLOAD_RETRY_AFTER_MS,
                )
            )
        async with self._uploads:
            return await self._upload(request, principal, store)

    async def _upload(self, request: Request, principal: Principal, store: FileStore) -> Response:
        parser = MultiPartParser(
            request.headers,
            self._limited(request.stream()),
            max_files=1,
            max_fields=4,
            max_part_size=MAX_FIELD_BYTES,
        )
        try:
            async with asyncio.timeout(self._upload_s):
                form = await parser.parse()
        except TimeoutError:
            return error_response(too_slow(self._upload_s))
        except _TooLarge:
            return error_response(too_large(self._max_bytes))
        except MultiPartException as exc:
            return error_response(invalid(f"body: {exc.message}"))
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if not isinstance(upload, UploadFile):
                return error_response(invalid("a multipart form with a `file` part", "file"))
            if purpose not in PURPOSES:
                return error_response(
                    invalid(f"purpose {purpose!r}: files here are for `batch` input", "purpose")
                )
            source: IO[bytes] = upload.file
            size = source.seek(0, 2)
            if size == 0:
                return error_response(invalid("the file is empty", "file"))
            source.seek(0)
            checked = await asyncio.to_thread(check_lines, source, self._streams.limits)
            if isinstance(checked, HttpError):
                log.info("file.refused", tenant=principal.tenant, reason=checked.body.error.message)
                return error_response(checked)
            filename = (upload.filename or "upload.jsonl")[:256]
            try:
                stored = await store.put(
                    principal.tenant, filename, source, size, checked.lines, tokens=checked.tokens
                )
            except (KafkaError, TimeoutError) as exc:
                log.warning("file.store_failed", tenant=principal.tenant, error=repr(exc))
                return error_response(unavailable())
            return JSONResponse(stored.model_dump())
        finally:
            await form.close()

    async def _limited(self, stream: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        size = 0
        async for chunk in stream:
            size += len(chunk)
            if size > self._max_bytes + FORM_SLACK_BYTES:
                raise _TooLarge
            yield chunk

    async def list(self, request: Request) -> Response:
        found = await self._owner(request)
        if isinstance(found, HttpError):
            return error_response(found)
        principal, store = found
        purpose = request.query_params.get("purpose")
        try:
            files = [s.file for s in await store.owned(principal.tenant)]
        except (KafkaError, TimeoutError) as exc:
            log.warning("file.read_failed", error=repr(exc))
            return error_response(unavailable())
        if purpose is not None:
            files = [f for f in files if f.purpose == purpose]
        if request.query_params.get("order") == "asc":
            files.reverse()
        body = listing(files, request.query_params)
        if isinstance(body, HttpError):
            return error_response(body)
        return JSONResponse(body)

    async def retrieve(self, request: Request) -> Response:
        found = await self._file(request)
        if isinstance(found, HttpError):
            return error_response(found)
        return JSONResponse(found[0].file.model_dump())

    async def content(self, request: Request) -> Response:
        found = await self._file(request)
        if isinstance(found, HttpError):
            return error_response(found)
        stored, store = found
        chunks = store.content(stored)
        try:  # the first chunk before the 200: a file that cannot be read is a 503
            first = await anext(chunks)
        except (KafkaError, TimeoutError, FileGone) as exc:
            log.warning("file.read_failed", file_id=stored.file.id, error=repr(exc))
            await chunks.aclose()
            return error_response(unavailable())

        async def body() -> AsyncIterator[bytes]:
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()

        return StreamingResponse(
            body(),
            media_type="application/octet-stream",
            headers={"Content-Length": str(stored.file.bytes)},
        )

    async def delete(self, request: Request) -> Response:
        found = await self._file(request)
        if isinstance(found, HttpError):
            return error_response(found)
        stored, store = found
        try:
            await store.delete(stored)
        except (KafkaError, TimeoutError) as exc:
            log.warning("file.delete_failed", file_id=stored.file.id, error=repr(exc))
            return error_response(unavailable())
        return JSONResponse({"id": stored.file.id, "object": "file", "deleted": True})

    async def _owner(self, request: Request) -> tuple[Principal, FileStore] | HttpError:
        principal = self._streams.authenticate(request.headers)
        if isinstance(principal, HttpError):
            return principal
        store = self._store()
        if store is None:
            return unavailable()
        return principal, store

    async def _file(self, request: Request) -> tuple[StoredFile, FileStore] | HttpError:
        """The file the path names, if the caller's tenant owns it; else 404."""
        found = await self._owner(request)
        if isinstance(found, HttpError):
            return found
        principal, store = found
        file_id: str = request.path_params["file_id"]
        try:
            stored = await store.find(principal.tenant, file_id)
        except (KafkaError, TimeoutError) as exc:
            log.warning("file.read_failed", file_id=file_id, error=repr(exc))
            return unavailable()
        if stored is None:
            return http_error(ErrorCode.not_found, f"No such File object: {file_id}", param="id")
        return stored, store


class Listed(Protocol):
    @property
    def id(self) -> str: ...

    def model_dump(self) -> dict[str, Any]: ...


def listing(items: Sequence[Listed], query: Mapping[str, str]) -> dict[str, Any] | HttpError:
    """OpenAI's list page of `items` (in the order shown): those after `after`, at most
    `limit`, with the ids that page on."""
    after = query.get("after")
    if after is not None:
        ids = [item.id for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    limit = page_limit(query.get("limit"))
    if isinstance(limit, HttpError):
        return limit
    page = items[:limit]
    return {
        "object": "list",
        "data": [item.model_dump() for item in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": len(items) > len(page),
    }


def page_limit(value: str | None) -> int | HttpError:
    if value is None:
        return 10_000
    if not value.isdigit() or not 1 <= int(value) <= 10_000:
        return invalid("limit: a whole number from 1 to 10000", "limit")
    return int(value)


def unavailable() -> HttpError:
    return http_error(
        ErrorCode.overloaded,
        "files are not reachable now (the broker is away); try again",
        retry_after_ms=UPLOAD_RETRY_AFTER_MS,
    )
