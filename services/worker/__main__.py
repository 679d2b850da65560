"""Entry point: `python -m services.worker`."""

from services.worker.app import Worker
from services.worker.engines.factory import build_engine
from services.worker.settings import WorkerSettings
from shared.health import health_port, with_health
from shared.logs import configure_logging
from shared.process import run_service
from shared.telemetry import start_telemetry


def main() -> None:
    settings = WorkerSettings()
    configure_logging("worker", settings.log_level, settings.log_format)
    telemetry = start_telemetry("worker")
    worker = Worker(settings, build_engine(settings))
    run_service(
        with_health(
            worker.run(),
            service="worker",
            port=health_port("worker", telemetry.metrics_port),
            host=telemetry.metrics_host,
            check=worker.readiness,
        )
    )


if __name__ == "__main__":
    main()
