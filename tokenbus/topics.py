"""`tokenbus topics create [--acls]`: every topic, its partitions and replication, and who
may use it."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from aiokafka.errors import KafkaError

from shared.kafka import (
    KafkaLoginRefused,
    cluster_replication,
    create_topics,
    make_admin,
    min_insync_replicas,
    wait_for_broker,
)
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tokenbus.acls import (
    ROLES,
    AclError,
    app_acls,
    create_acls,
    parse_apps,
    parse_principals,
    service_acls,
)
from tokenbus.app_quotas import (
    DEFAULT_APP_PRODUCE_BYTES_PER_S,
    QuotaError,
    set_app_quotas,
    user_of,
)

if TYPE_CHECKING:
    from tokenbus.commands import Subcommands

BROKER_TIMEOUT_S = 15.0


async def ensure_topics(
    settings: TokenbusSettings, replication: int | None = None, apps: Iterable[str] = ()
) -> None:
    """Create the topics that are missing and print, per topic, what was done.

    `replication` defaults to min(3, brokers in the cluster), as for every topic made.
    `apps`: outside applications whose own requests and reply topics are made too.
    """
    topics = Topics(settings.topic_prefix)
    wanted = topics.partitions()
    for app in apps:
        wanted.update(topics.app_partitions(app))
    if replication is None:
        replication = await _cluster_replication(settings)
    configs = settings.topic_configs()
    for app in apps:
        configs.update(topics.app_configs(app))
    created = set(await create_topics(settings, wanted, replication, configs=configs))
    single = topics.single_copy()
    for name, partitions in wanted.items():
        # Partition counts and replication of existing topics are left alone: shrinking is
        # impossible and growing would move keys to other partitions under running consumers.
        if name in created:
            n = 1 if name in single else replication
            copies = f"replication {n}, min.insync.replicas {min_insync_replicas(n)}"
            print(f"created  {name} ({partitions} partitions, {copies})", flush=True)
        else:
            print(f"existed  {name} ({partitions} partitions)", flush=True)


async def _cluster_replication(settings: TokenbusSettings) -> int:
    admin = make_admin(settings)
    await admin.start()
    try:
        return await cluster_replication(admin)
    finally:
        await admin.close()


async def grant_acls(
    settings: TokenbusSettings,
    principals: Mapping[str, str],
    apps: Mapping[str, str] | None = None,
) -> None:
    """Grant every role its least-privilege ACLs on this deployment's topics, and each
    application (`apps`: name -> principal) its own; print each."""
    topics = Topics(settings.topic_prefix)
    acls = service_acls(topics, principals)
    for app, principal in (apps or {}).items():
        acls += app_acls(topics, app, principal)
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
        "--replication-factor", type=int, default=None, metavar="N",
        help="copies of each new topic; min.insync.replicas is 2 from 3 copies, else 1 "
        "(default: min(3, brokers in the cluster))",
    )  # fmt: skip
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
    create.add_argument(
        "--app",
        action="append",
        default=[],
        metavar="NAME[=PRINCIPAL]",
        help="an outside application: create its requests topic (<prefix>.app-requests.NAME)"
        " and reply topic (<prefix>.replies.NAME); with --acls, its principal (default"
        " User:NAME) may write the one and read the other, nothing else, at most"
        " --app-produce-bytes-per-s; list it in ingest's TOKENBUS_INGEST_APPS; repeatable",
    )
    create.add_argument(
        "--app-produce-bytes-per-s",
        type=int,
        default=DEFAULT_APP_PRODUCE_BYTES_PER_S,
        metavar="N",
        help="with --acls: the Kafka produce quota (producer_byte_rate, per broker) of each"
        f" --app principal (default {DEFAULT_APP_PRODUCE_BYTES_PER_S})",
    )
    create.set_defaults(handler=_create)


def _create(args: argparse.Namespace) -> int:
    try:
        principals = parse_principals(args.principal)
        apps = parse_apps(args.app)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = TokenbusSettings()
    if args.app_produce_bytes_per_s < 1:
        print("error: --app-produce-bytes-per-s must be at least 1", file=sys.stderr)
        return 2
    try:
        for principal in apps.values():
            user_of(principal)  # its produce quota is set for its user
    except ValueError as exc:
        print(f"error: --app: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(
            _wait_and_create(
                settings,
                args.replication_factor,
                principals if args.acls else None,
                apps,
                args.app_produce_bytes_per_s,
            )
        )
    except (TimeoutError, KafkaError, KafkaLoginRefused, AclError, QuotaError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


async def _wait_and_create(
    settings: TokenbusSettings,
    replication: int | None,
    principals: Mapping[str, str] | None,
    apps: Mapping[str, str],
    app_produce_bytes_per_s: int = DEFAULT_APP_PRODUCE_BYTES_PER_S,
) -> None:
    await wait_for_broker(settings, timeout_s=BROKER_TIMEOUT_S)
    await ensure_topics(settings, replication, apps)
    if principals is not None:
        await grant_acls(settings, principals, apps)
        await set_app_quotas(settings, apps, app_produce_bytes_per_s)
