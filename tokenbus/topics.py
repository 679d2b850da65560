"""`tokenbus topics create`: every topic of the deployment, with its partition count."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from shared.kafka import create_topics, wait_for_broker
from shared.settings import TokenbusSettings
from shared.topics import Topics

if TYPE_CHECKING:
    from tokenbus.cli import Subcommands

BROKER_TIMEOUT_S = 15.0


async def ensure_topics(settings: TokenbusSettings) -> None:
    """Create the topics that are missing and print, per topic, what was done."""
    wanted = Topics(settings.topic_prefix).partitions()
    created = set(await create_topics(settings, wanted))
    for name, partitions in wanted.items():
        # Partition counts of existing topics are left alone: shrinking is impossible and
        # growing would move keys to other partitions under running consumers.
        state = "created" if name in created else "existed"
        print(f"{state:8} {name} ({partitions} partitions)", flush=True)


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("topics", help="manage the deployment's Kafka topics")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser(
        "create", help="create every topic that does not exist yet (explicit partition counts)"
    )
    create.set_defaults(handler=_create)


def _create(args: argparse.Namespace) -> int:
    settings = TokenbusSettings()
    try:
        asyncio.run(_wait_and_create(settings))
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


async def _wait_and_create(settings: TokenbusSettings) -> None:
    await wait_for_broker(settings, timeout_s=BROKER_TIMEOUT_S)
    await ensure_topics(settings)
