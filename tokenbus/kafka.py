"""`tokenbus kafka start|stop|status`: the local broker, run by `deploy.kafka.launcher`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deploy.kafka import launcher

if TYPE_CHECKING:
    from tokenbus.commands import Subcommands


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "kafka",
        help="run a local single-node Kafka on the JVM (no Docker)",
        description=launcher.__doc__,
    )
    launcher.add_arguments(parser)
    parser.set_defaults(handler=launcher.run)
