"""Entry point: `python -m services.worker`."""

from services.worker.app import Worker
from services.worker.engines.factory import build_engine
from services.worker.settings import WorkerSettings
from shared.logs import configure_logging
from shared.process import run_service
from shared.telemetry import start_telemetry


def main() -> None:
    settings = WorkerSettings()
    configure_logging("worker", settings.log_level)
    start_telemetry("worker")
    run_service(Worker(settings, build_engine(settings)).run())


if __name__ == "__main__":
    main()
