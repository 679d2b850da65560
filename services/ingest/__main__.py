"""Entry point: `python -m services.ingest`."""

from aiokafka import AIOKafkaConsumer

from services.ingest.app import serve
from services.ingest.settings import IngestSettings
from shared.health import consumer_readiness, health_port, with_health
from shared.logs import configure_logging
from shared.process import run_service
from shared.telemetry import start_telemetry


def main() -> None:
    settings = IngestSettings()
    configure_logging("ingest", settings.log_level, settings.log_format)
    telemetry = start_telemetry("ingest")
    consumers: list[AIOKafkaConsumer | None] = [None]  # the request reader, once built
    run_service(
        with_health(
            serve(settings, built=lambda consumer: consumers.__setitem__(0, consumer)),
            service="ingest",
            port=health_port("ingest", telemetry.metrics_port),
            host=telemetry.metrics_host,
            check=lambda: consumer_readiness(consumers),
        )
    )


if __name__ == "__main__":
    main()
