"""`tokenbus topics create [--acls]`: every topic of the deployment, and who may use it."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from shared.kafka import KafkaLoginRefused, create_topics, wait_for_broker
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tokenbus.acls import ROLES, AclError, create_acls, parse_principals, service_acls

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


async def grant_acls(settings: TokenbusSettings, principals: Mapping[str, str]) -> None:
    """Grant every role its least-privilege ACLs on this deployment's topics; print each."""
    acls = service_acls(Topics(settings.topic_prefix), principals)
    await create_acls(settings, acls)
    for acl in acls:
        print(f"acl      {acl}", flush=True)


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("topics", help="manage the deployment's Kafka topics")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser(
        "create", help="create every topic that does not exist yet (explicit partition counts)"
    )
    create.add_argument(
        "--acls",
        action="store_true",
        help="also grant each service's principal only what it needs (a broker with an "
        "authorizer; run with an admin principal's TOKENBUS_KAFKA_* settings)",
    )
    create.add_argument(
        "--principal",
        action="append",
        default=[],
        metavar="ROLE=PRINCIPAL",
        help=f"principal of a role ({', '.join(ROLES)}); default User:<role>; repeatable",
    )
    create.set_defaults(handler=_create)


def _create(args: argparse.Namespace) -> int:
    try:
        principals = parse_principals(args.principal)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = TokenbusSettings()
    try:
        asyncio.run(_wait_and_create(settings, principals if args.acls else None))
    except (TimeoutError, KafkaLoginRefused, AclError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


async def _wait_and_create(
    settings: TokenbusSettings, principals: Mapping[str, str] | None
) -> None:
    await wait_for_broker(settings, timeout_s=BROKER_TIMEOUT_S)
    await ensure_topics(settings)
    if principals is not None:
        await grant_acls(settings, principals)
