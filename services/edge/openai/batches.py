"""OpenAI's Batch API (issue 39, ADR 0075): `POST /v1/batches`, `GET /v1/batches/{id}`,
`GET /v1/batches`, `POST /v1/batches/{id}/cancel`.

Creating a batch writes its record to the bus and answers at once (`validating`); the edge
that holds its partition runs it (services/edge/batch_runner.py). A batch is its tenant's:
another tenant's key gets 404, as for a batch that does not exist.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import structlog
from aiokafka.errors import KafkaError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.edge.keys import Principal
from services.edge.openai.batch_lines import ENDPOINTS
from services.edge.openai.errors import HttpError, http_error, invalid
from services.edge.openai.files import listing, unavailable
from services.edge.openai.routes import Streams, error_response, read_body
from services.edge.openai.schema import ErrorBody, ErrorDetail
from shared.batch_jobs import ENDED, WINDOWS, BatchJobs, BatchObject
from shared.files import FileStore
from shared.messages import ErrorCode, error_message

log = structlog.get_logger()

MAX_BODY_BYTES = 64 * 1024
MAX_METADATA = 16


class CreateBatch(BaseModel):
    """`client.batches.create(...)`'s body."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # taken, not applied: files are kept


class BatchesApi:
    """The handlers; `jobs()`, `files()` are None until the edge has reached Kafka."""

    def __init__(
        self,
        streams: Streams,
        jobs: Callable[[], BatchJobs | None],
        files: Callable[[], FileStore | None],
    ) -> None:
        self._streams = streams
        self._jobs = jobs
        self._files = files

    async def create(self, request: Request) -> Response:
        found = self._caller(request)
        if isinstance(found, HttpError):
            return error_response(found)
        principal, jobs, files = found
        asked = await _create_body(request)
        if isinstance(asked, HttpError):
            return error_response(asked)
        try:
            stored = await files.find(principal.tenant, asked.input_file_id)
            if stored is None:
                return error_response(
                    http_error(
                        ErrorCode.not_found,
                        f"No such File object: {asked.input_file_id}",
                        param="input_file_id",
                    )
                )
            if stored.file.purpose != "batch":
                return error_response(
                    invalid(
                        f"file {asked.input_file_id} has purpose {stored.file.purpose!r}:"
                        " a batch's input is a file of purpose `batch`",
                        "input_file_id",
                    )
                )
            if refused := await _over_quota(jobs, principal, stored.tokens or 0):
                return error_response(refused)
            batch = await jobs.create(
                principal.tenant,
                principal.plan,
                input_file_id=asked.input_file_id,
                endpoint=asked.endpoint,  # type: ignore[arg-type]
                metadata=asked.metadata,
                tokens=stored.tokens,
            )
        except (KafkaError, TimeoutError) as exc:
            log.warning("batch.create_failed", tenant=principal.tenant, error=repr(exc))
            return error_response(unavailable())
        log.info("batch.created", batch_id=batch.id, tenant=principal.tenant, lines=stored.lines)
        return JSONResponse(batch.model_dump())

    async def retrieve(self, request: Request) -> Response:
        found = await self._batch(request)
        if isinstance(found, HttpError):
            return error_response(found)
        return JSONResponse(found[0].model_dump())

    async def cancel(self, request: Request) -> Response:
        found = await self._batch(request)
        if isinstance(found, HttpError):
            return error_response(found)
        batch, jobs, tenant = found
        if batch.status in ("cancelling", "cancelled"):
            return JSONResponse(batch.model_dump())
        if batch.status in ENDED:
            detail = ErrorDetail(
                message=f"Cannot cancel a batch with status '{batch.status}'.",
                type="invalid_request_error",
                param=None,
                code="batch_not_cancellable",
            )
            return error_response(HttpError(409, ErrorBody(error=detail)))
        try:
            await jobs.cancel(batch.id)
            cancelled = await jobs.find(tenant, batch.id)
        except (KafkaError, TimeoutError) as exc:
            log.warning("batch.cancel_failed", batch_id=batch.id, error=repr(exc))
            return error_response(unavailable())
        log.info("batch.cancel", batch_id=batch.id)
        return JSONResponse((cancelled or batch).model_dump())

    async def list(self, request: Request) -> Response:
        found = self._caller(request)
        if isinstance(found, HttpError):
            return error_response(found)
        principal, jobs, _ = found
        try:
            batches = await jobs.owned(principal.tenant)
        except (KafkaError, TimeoutError) as exc:
            log.warning("batch.read_failed", error=repr(exc))
            return error_response(unavailable())
        body = listing(batches, request.query_params)
        if isinstance(body, HttpError):
            return error_response(body)
        return JSONResponse(body)

    def _caller(self, request: Request) -> tuple[Principal, BatchJobs, FileStore] | HttpError:
        principal = self._streams.authenticate(request.headers)
        if isinstance(principal, HttpError):
            return principal
        jobs, files = self._jobs(), self._files()
        if jobs is None or files is None:
            return unavailable()
        return principal, jobs, files

    async def _batch(self, request: Request) -> tuple[BatchObject, BatchJobs, str] | HttpError:
        """The batch the path names, its table and its tenant, if the caller's tenant owns
        it; else 404."""
        found = self._caller(request)
        if isinstance(found, HttpError):
            return found
        principal, jobs, _ = found
        batch_id: str = request.path_params["batch_id"]
        try:
            batch = await jobs.find(principal.tenant, batch_id)
        except (KafkaError, TimeoutError) as exc:
            log.warning("batch.read_failed", batch_id=batch_id, error=repr(exc))
            return unavailable()
        if batch is None:
            return http_error(ErrorCode.not_found, f"No such Batch object: {batch_id}", param="id")
        return batch, jobs, principal.tenant


DAY_S = 24 * 3600


async def _over_quota(jobs: BatchJobs, principal: Principal, tokens: int) -> HttpError | None:
    """The tenant's `batch_tokens_per_day`, counted over its batches of the last 24 hours as
    the bus has them (so it holds across every edge): 429 with when a batch will have left
    the window, or 400 for a batch larger than the whole allowance."""
    limit = principal.limits.batch_tokens_per_day
    if limit is None:
        return None
    if tokens > limit:
        return invalid(
            f"batch_tokens_per_day: the file's requests may use {tokens} tokens, above the"
            f" tenant's whole allowance of {limit} a day; split it",
            "input_file_id",
        )
    now = time.time()
    counted = await jobs.spent(principal.tenant, now - DAY_S)
    used = sum(t for _, t in counted)
    if used + tokens <= limit:
        return None
    # The oldest batches leave the window first: wait until enough of them have.
    freed, wait_s = 0, float(DAY_S)
    for created_at, spent in counted:
        freed += spent
        if used - freed + tokens <= limit:
            wait_s = max(1.0, created_at + DAY_S - now)
            break
    return http_error(
        ErrorCode.rate_limited,
        f"rate_limited (batch_tokens_per_day): this batch may use {tokens} tokens and the"
        f" tenant's batches of the last 24 hours {used} of {limit}",
        retry_after_ms=int(wait_s * 1000),
    )


async def _create_body(request: Request) -> CreateBatch | HttpError:
    raw = await read_body(request, MAX_BODY_BYTES)
    if isinstance(raw, HttpError):
        return raw
    try:
        asked = CreateBatch.model_validate(json.loads(raw))
    except ValidationError as exc:
        return invalid(error_message(exc))
    except (ValueError, RecursionError):
        return invalid("body: not valid JSON")
    if asked.endpoint not in ENDPOINTS:
        known = " or ".join(ENDPOINTS)
        return invalid(f"endpoint {asked.endpoint!r} is not served here: {known}", "endpoint")
    if asked.completion_window not in WINDOWS:
        return invalid(
            f"completion_window {asked.completion_window!r}: the only window is `24h`",
            "completion_window",
        )
    metadata = asked.metadata or {}
    if len(metadata) > MAX_METADATA or any(
        len(k) > 64 or len(v) > 512 for k, v in metadata.items()
    ):
        return invalid(
            "metadata: at most 16 pairs, keys of 64 characters, values of 512", "metadata"
        )
    return asked
