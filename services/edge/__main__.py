"""Entry point: `python -m services.edge`."""

import asyncio

import uvicorn
from pydantic import ValidationError

from services.edge.app import Edge, build_app
from services.edge.drain import DrainingServer
from services.edge.listener import uvicorn_options
from services.edge.settings import EdgeSettings
from shared.health import health_port, with_health
from shared.logs import configure_logging
from shared.process import UVICORN_LOOP
from shared.telemetry import start_telemetry

# The exit status of `uvicorn.run` when the app's lifespan fails to start (uvicorn.main).
STARTUP_FAILURE = 3


def main() -> None:
    try:
        settings = EdgeSettings()
    except ValidationError as exc:  # e.g. no resume secret: say so, without a traceback
        raise SystemExit(f"edge: refusing to start: {exc}") from None
    configure_logging("edge", settings.log_level, settings.log_format)
    telemetry = start_telemetry("edge")
    edge = Edge(settings)
    config = uvicorn.Config(
        build_app(edge),
        **uvicorn_options(settings),  # where it listens, and its limits (listener.py)
        log_level="warning",
        lifespan="on",
        loop=UVICORN_LOOP,
    )
    # Owns SIGINT and SIGTERM, as under `uvicorn.run`; the first drains the edge (drain.py).
    server = DrainingServer(config, edge.start_drain)
    # /metrics on its own port (TOKENBUS_METRICS_HOST, loopback by default), never on the
    # public one; /healthz and /readyz answer on both.
    serving = with_health(
        server.serve(),
        service="edge",
        port=health_port("edge", telemetry.metrics_port),
        host=telemetry.metrics_host,
        check=edge.readiness,
        registry=edge.metrics.registry,
    )
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(serving)
    if not server.started:  # its lifespan failed: exit as `uvicorn.run` does
        raise SystemExit(STARTUP_FAILURE)


if __name__ == "__main__":
    main()
