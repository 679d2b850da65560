"""Entry point: `python -m services.ingest`."""

from services.ingest.app import serve
from services.ingest.settings import IngestSettings
from shared.logs import configure_logging
from shared.process import run_service
from shared.telemetry import start_telemetry


def main() -> None:
    settings = IngestSettings()
    configure_logging("ingest", settings.log_level)
    start_telemetry("ingest")
    run_service(serve(settings))


if __name__ == "__main__":
    main()
