"""Entry point: `python -m services.scheduler`."""

from services.scheduler.app import Scheduler, serve
from services.scheduler.settings import SchedulerSettings
from shared.health import Readiness, health_port, with_health
from shared.logs import configure_logging
from shared.process import run_service
from shared.telemetry import start_telemetry


def main() -> None:
    settings = SchedulerSettings()
    configure_logging("scheduler", settings.log_level, settings.log_format)
    telemetry = start_telemetry("scheduler")
    built: list[Scheduler] = []  # the one scheduler, once `serve` has its clients

    async def readiness() -> Readiness:
        return await built[0].readiness() if built else Readiness.not_ready("starting")

    run_service(
        with_health(
            serve(settings, built=built.append),
            service="scheduler",
            port=health_port("scheduler", telemetry.metrics_port),
            host=telemetry.metrics_host,
            check=readiness,
        )
    )


if __name__ == "__main__":
    main()
