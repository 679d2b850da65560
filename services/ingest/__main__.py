"""Entry point: `python -m services.ingest`."""

import asyncio

from faststream import FastStream

from services.ingest.app import serve
from services.ingest.settings import IngestSettings
from shared.health import consumer_readiness, health_port, subscriber_consumers, with_health
from shared.logs import configure_logging
from shared.telemetry import start_telemetry


def main() -> None:
    settings = IngestSettings()
    configure_logging("ingest", settings.log_level, settings.log_format)
    telemetry = start_telemetry("ingest")
    apps: list[FastStream] = []  # the one app, once `serve` has built it
    # FastStream handles SIGINT/SIGTERM itself and closes the broker gracefully.
    asyncio.run(
        with_health(
            serve(settings, built=apps.append),
            service="ingest",
            port=health_port("ingest", telemetry.metrics_port),
            host=telemetry.metrics_host,
            check=lambda: consumer_readiness(subscriber_consumers(apps)),
        )
    )


if __name__ == "__main__":
    main()
