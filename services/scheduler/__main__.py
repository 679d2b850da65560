"""Entry point: `python -m services.scheduler`."""

from services.scheduler.app import serve
from services.scheduler.settings import SchedulerSettings
from shared.logs import configure_logging
from shared.process import run_service
from shared.telemetry import start_telemetry


def main() -> None:
    settings = SchedulerSettings()
    configure_logging("scheduler", settings.log_level)
    start_telemetry("scheduler")
    run_service(serve(settings))


if __name__ == "__main__":
    main()
