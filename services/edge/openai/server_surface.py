"""vLLM's server surface beside the OpenAI API, which its tools check before they start
(guidellm's backend check asks `GET /health`; load balancers and SageMaker ask `/ping`):
`/health` and `/ping` answer 200 with an empty body while the edge can take requests and
503 while it cannot (no broker, draining), as vLLM's answer 503 for a dead engine; `/version`
is `{"version": ...}`, tokenbus's. No key is asked, as vLLM asks none for these."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from shared.health import ReadinessCheck


def tokenbus_version() -> str:
    try:
        return version("tokenbus")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def server_routes(check: ReadinessCheck) -> list[Route]:
    async def health(request: Request) -> Response:
        return Response(status_code=200 if (await check()).ready else 503)

    async def server_version(request: Request) -> Response:
        return JSONResponse({"version": tokenbus_version()})

    return [
        Route("/health", health),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/version", server_version),
    ]
