"""Entry point: `python -m services.ingest`."""

from services.ingest.app import serve
from services.ingest.settings import IngestSettings
from shared.health import Starting, health_port, with_health
from shared.logs import configure_logging
from shared.process import run_service
from shared.telemetry import start_telemetry


def main() -> None:
    settings = IngestSettings()
    configure_logging("ingest", settings.log_level, settings.log_format)
    telemetry = start_telemetry("ingest")
    starting = Starting()  # the request reader answers /readyz once built
    run_service(
        with_health(
            serve(settings, built=starting.built),
            service="ingest",
            port=health_port("ingest", telemetry.metrics_port),
            host=telemetry.metrics_host,
            check=starting.readiness,
        )
    )


if __name__ == "__main__":
    main()
