"""Entry point: `python -m services.edge`."""

import uvicorn
from pydantic import ValidationError

from services.edge.app import build_app
from services.edge.settings import EdgeSettings
from shared.logs import configure_logging
from shared.process import UVICORN_LOOP
from shared.telemetry import start_telemetry


def main() -> None:
    try:
        settings = EdgeSettings()
    except ValidationError as exc:  # e.g. no resume secret: say so, without a traceback
        raise SystemExit(f"edge: refusing to start: {exc}") from None
    configure_logging("edge", settings.log_level, settings.log_format)
    start_telemetry("edge")
    uvicorn.run(
        build_app(settings),
        host=settings.edge_host,
        port=settings.edge_port,
        # Read frames up to 4x the answered limit, so an oversized frame gets a polite
        # invalid_request instead of a closed socket.
        ws_max_size=settings.edge_max_frame_bytes * 4,
        log_level="warning",
        lifespan="on",
        loop=UVICORN_LOOP,
    )


if __name__ == "__main__":
    main()
