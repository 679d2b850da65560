"""Entry point: `python -m services.scheduler`."""

from services.scheduler.app import serve
from services.scheduler.settings import SchedulerSettings
from shared.health import Starting, health_port, with_health
from shared.logs import configure_logging
from shared.process import run_service
from shared.telemetry import start_telemetry


def main() -> None:
    settings = SchedulerSettings()
    configure_logging("scheduler", settings.log_level, settings.log_format)
    telemetry = start_telemetry("scheduler")
    starting = Starting()  # the scheduler answers /readyz once `serve` has built it
    run_service(
        with_health(
            serve(settings, built=starting.built),
            service="scheduler",
            port=health_port("scheduler", telemetry.metrics_port),
            host=telemetry.metrics_host,
            check=starting.readiness,
        )
    )


if __name__ == "__main__":
    main()
