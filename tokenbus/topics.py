"""`tokenbus topics create`: every topic of the deployment, its partitions and replication."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from shared.kafka import cluster_replication, create_topics, min_insync_replicas, wait_for_broker
from shared.settings import TokenbusSettings
from shared.topics import Topics

if TYPE_CHECKING:
    from tokenbus.cli import Subcommands

BROKER_TIMEOUT_S = 15.0


async def ensure_topics(settings: TokenbusSettings, replication: int | None = None) -> None:
    """Create the topics that are missing and print, per topic, what was done.

    `replication` defaults to min(3, brokers in the cluster), as for every topic made.
    """
    wanted = Topics(settings.topic_prefix).partitions()
    if replication is None:
        replication = await _cluster_replication(settings)
    created = set(await create_topics(settings, wanted, replication))
    copies = f"replication {replication}, min.insync.replicas {min_insync_replicas(replication)}"
    for name, partitions in wanted.items():
        # Partition counts and replication of existing topics are left alone: shrinking is
        # impossible and growing would move keys to other partitions under running consumers.
        if name in created:
            print(f"created  {name} ({partitions} partitions, {copies})", flush=True)
        else:
            print(f"existed  {name} ({partitions} partitions)", flush=True)


async def _cluster_replication(settings: TokenbusSettings) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
    await admin.start()
    try:
        return await cluster_replication(admin)
    finally:
        await admin.close()


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("topics", help="manage the deployment's Kafka topics")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser(
        "create", help="create every topic that does not exist yet (explicit partition counts)"
    )
    create.add_argument(
        "--replication-factor", type=int, default=None, metavar="N",
        help="copies of each new topic; min.insync.replicas is 2 from 3 copies, else 1 "
        "(default: min(3, brokers in the cluster))",
    )  # fmt: skip
    create.set_defaults(handler=_create)


def _create(args: argparse.Namespace) -> int:
    settings = TokenbusSettings()
    try:
        asyncio.run(_wait_and_create(settings, args.replication_factor))
    except (TimeoutError, KafkaError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


async def _wait_and_create(settings: TokenbusSettings, replication: int | None) -> None:
    await wait_for_broker(settings, timeout_s=BROKER_TIMEOUT_S)
    await ensure_topics(settings, replication)
