"""Protocol error codes as OpenAI error responses: the HTTP status, the body, the retry hint."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.edge.openai.schema import ErrorBody, ErrorDetail
from shared.messages import ErrorCode

# code -> (HTTP status, OpenAI error `type`). The SDK picks its exception by status
# (BadRequestError, AuthenticationError, NotFoundError, RateLimitError, ...).
_STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.invalid_request: (400, "invalid_request_error"),
    ErrorCode.unauthorized: (401, "invalid_request_error"),
    ErrorCode.not_found: (404, "invalid_request_error"),
    ErrorCode.rate_limited: (429, "rate_limit_error"),
    ErrorCode.overloaded: (503, "server_error"),
    ErrorCode.deadline_exceeded: (504, "timeout_error"),
    # nginx's "client closed request": only a request whose client is gone is cancelled.
    ErrorCode.cancelled: (499, "cancelled"),
    ErrorCode.internal: (500, "server_error"),
}
# OpenAI's own `code` strings where it has one; tokenbus's code otherwise.
_OPENAI_CODE: dict[ErrorCode, str] = {
    ErrorCode.unauthorized: "invalid_api_key",
    ErrorCode.rate_limited: "rate_limit_exceeded",
}


@dataclass(frozen=True)
class HttpError:
    """One error answer: status, OpenAI-shaped body, extra headers."""

    status: int
    body: ErrorBody
    headers: dict[str, str] = field(default_factory=dict)


def http_error(
    code: ErrorCode,
    message: str,
    *,
    retry_after_ms: int | None = None,
    param: str | None = None,
    openai_code: str | None = None,
) -> HttpError:
    status, kind = _STATUS[code]
    detail = ErrorDetail(
        message=message,
        type=kind,
        param=param,
        code=openai_code or _OPENAI_CODE.get(code, code.value),
    )
    headers: dict[str, str] = {}
    if retry_after_ms is not None:
        # Retry-After counts whole seconds (RFC 9110); never 0, which reads as "now".
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_ms / 1000)))
        # The exact hint: the `openai` SDK reads `retry-after-ms`; the tokenbus name stays.
        headers["retry-after-ms"] = str(retry_after_ms)
        headers["X-Tokenbus-Retry-After-Ms"] = str(retry_after_ms)
    return HttpError(status, ErrorBody(error=detail), headers)


def invalid(message: str, param: str | None = None) -> HttpError:
    return http_error(ErrorCode.invalid_request, message, param=param)


def unknown_model(message: str, param: str = "model") -> HttpError:
    """OpenAI's answer to a model it does not serve: 404, `invalid_request_error`."""
    return http_error(ErrorCode.not_found, message, param=param, openai_code="model_not_found")


def too_large(limit: int) -> HttpError:
    """A body above `limit` bytes: 413, and the connection closed (the rest is never read)."""
    return _body_refused(413, f"body: above the limit of {limit} bytes", "request_too_large")


# A draining edge's answers say to go on at another edge now: the hint is short.
RESTART_RETRY_AFTER_MS = 100


def restarting(resume_from: str | None = None) -> HttpError:
    """The edge is restarting (services/edge/drain.py): 503 `edge_restarting`, to be sent
    again to another edge; for a stream cut short, `resume_from` is its last event's id."""
    message = "the edge is restarting: send the request again to another edge"
    if resume_from is not None:
        message += (
            f" with `Last-Event-ID: {resume_from}` and its `X-Tokenbus-Resume-Token` to go on"
            " from this event"
        )
    return http_error(
        ErrorCode.overloaded,
        message,
        retry_after_ms=RESTART_RETRY_AFTER_MS,
        openai_code="edge_restarting",
    )


def too_slow(timeout_s: float) -> HttpError:
    """A body not whole within `timeout_s` of its head: 408, and the connection closed."""
    return _body_refused(408, f"body: not received whole within {timeout_s:g} s", "request_timeout")


def _body_refused(status: int, message: str, code: str) -> HttpError:
    """A body refused before it was read whole: the connection closes with the answer."""
    detail = ErrorDetail(message=message, type="invalid_request_error", param=None, code=code)
    return HttpError(status, ErrorBody(error=detail), {"Connection": "close"})


def bodies_busy(retry_after_ms: int) -> HttpError:
    """The edge holds as many unread request bodies as it may: 503, try again."""
    return http_error(
        ErrorCode.overloaded,
        "the edge is reading as many request bodies as it may; try again",
        retry_after_ms=retry_after_ms,
    )
