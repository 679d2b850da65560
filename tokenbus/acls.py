"""Least-privilege Kafka ACLs: what each tokenbus service's principal may do, and granting it."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum

from aiokafka.errors import for_code
from aiokafka.protocol.admin import CreateAclsRequest

from shared.kafka import make_admin
from shared.messages import Tier
from shared.settings import TokenbusSettings
from shared.topics import APP_NAME, Topics, app_name_problem

# Every service role that talks to Kafka. An outside application is not a role: each one
# has its own principal and topics (`app_acls`), so none can act as another (ADR 0044).
ROLES = ("edge", "ingest", "scheduler", "worker")


# Kafka's wire codes (org.apache.kafka.common.resource / .acl); aiokafka has no enums for them.
class Resource(IntEnum):
    TOPIC = 2
    GROUP = 3
    TRANSACTIONAL_ID = 5


class Pattern(IntEnum):
    LITERAL = 3
    PREFIXED = 4


class Operation(IntEnum):
    READ = 3
    WRITE = 4
    CREATE = 5
    DELETE = 6
    DESCRIBE_CONFIGS = 10
    ALTER_CONFIGS = 11


class Permission(IntEnum):
    DENY = 2
    ALLOW = 3


@dataclass(frozen=True)
class Acl:
    """One ACL binding: `permission` for `principal` to do `operation` on a resource pattern."""

    principal: str
    resource: Resource
    name: str
    pattern: Pattern
    operation: Operation
    permission: Permission = Permission.ALLOW
    host: str = "*"

    def __str__(self) -> str:
        where = f"{self.name}*" if self.pattern is Pattern.PREFIXED else self.name
        return (
            f"{self.permission.name.lower():5} {self.principal} {self.operation.name} "
            f"{self.resource.name.lower()} {where}"
        )


def reply_prefix(topics: Topics) -> str:
    """Where outside applications' reply topics live: `<prefix>.replies.<app>`
    (`Topics.app_replies`); services write results there, each application reads its own."""
    return topics.app_replies("")


def default_principals() -> dict[str, str]:
    """Role -> principal: each service logs in as the SASL user named after its role."""
    return {role: f"User:{role}" for role in ROLES}


@dataclass(frozen=True)
class Grant:
    """What one role may do on one resource pattern, and why (the README's "what runs
    where" table is generated from these: `tokenbus acls`)."""

    resource: Resource
    name: str
    pattern: Pattern
    operations: tuple[Operation, ...]
    permission: Permission = Permission.ALLOW
    why: str = ""


def _topic(name: str, *ops: Operation, why: str = "") -> Grant:
    return Grant(Resource.TOPIC, name, Pattern.LITERAL, ops, why=why)


def _topics_under(prefix: str, *ops: Operation, why: str = "") -> Grant:
    return Grant(Resource.TOPIC, prefix, Pattern.PREFIXED, ops, why=why)


def grants(topics: Topics) -> dict[str, list[Grant]]:
    """What each role needs, read off what its code does (DESCRIBE comes with READ/WRITE).

    Idempotent producers need no IDEMPOTENT_WRITE on the cluster: Kafka 3+ allows them to
    a principal that may WRITE some topic (KIP-679).
    """
    read, write = Operation.READ, Operation.WRITE
    tiers = [topics.tier(t) for t in Tier]
    per_request = topics.results + "."  # the edge's per-request result topics

    # Results go where a request's reply_to says: the shared results topic, an edge's
    # per-request topic, or an outside application's reply topic. Never the lease log,
    # which `<prefix>.results.` also matches: a DENY there outranks the prefixed ALLOW.
    def results_out(why: str) -> list[Grant]:
        return [
            _topic(topics.results, write, why=why),
            _topics_under(per_request, write, why=why),
            _topics_under(reply_prefix(topics), write, why=why),
            Grant(
                Resource.TOPIC,
                topics.result_leases,
                Pattern.LITERAL,
                (write,),
                Permission.DENY,
                why="the edges' lease log, which `results.` also matches",
            ),
        ]

    # Whoever takes over a dead worker's work first reads whether a request was answered
    # already (shared/finals.py): the same topics, read, the lease log still excluded.
    answered = "whether a request was answered already, before a hand-back (shared/finals.py)"
    results_in = [
        _topic(topics.results, read, why=answered),
        _topics_under(per_request, read, why=answered),
        _topics_under(reply_prefix(topics), read, why=answered),
        Grant(
            Resource.TOPIC,
            topics.result_leases,
            Pattern.LITERAL,
            (read,),
            Permission.DENY,
            why="the edges' lease log",
        ),
    ]
    worker_groups = Grant(
        Resource.GROUP,
        topics.worker_group(""),
        Pattern.PREFIXED,
        (read,),
        why="each worker's batch progress, committed under `worker.<id>`",
    )
    # A worker's unfinished batches are re-issued under a transactional id named like its
    # group, by the scheduler's recovery or by the worker's own next process.
    worker_txns = Grant(
        Resource.TRANSACTIONAL_ID,
        topics.worker_group(""),
        Pattern.PREFIXED,
        (write,),
        why="one transaction re-issues a worker's unfinished batches (ADR 0021)",
    )
    return {
        "edge": [
            _topic(
                topics.requests,
                write,
                why="a request the response cache may answer (it goes through ingest)",
            ),
            *(
                _topic(t, write, why="any other request, straight to its tier (ADR 0041)")
                for t in tiers
            ),
            _topic(topics.control, read, write, why="cancels out; resume hand-overs in and out"),
            _topic(
                topics.results, read, why="its streams: the partition it holds; a resumed stream's"
            ),
            _topic(topics.workers, read, why="heartbeats: the models `/v1/models` lists"),
            _topic(topics.files, read, write, why="the uploaded files' records (ADR 0074)"),
            _topic(topics.file_chunks, read, write, why="the uploaded files' content (ADR 0074)"),
            _topic(topics.batch_jobs, read, write, why="the batches and their cancels (ADR 0075)"),
            _topic(topics.batch_outcomes, read, write, why="each batch line's outcome (ADR 0075)"),
            Grant(
                Resource.GROUP,
                topics.batch_runners,
                Pattern.LITERAL,
                (read,),
                why="the batch runners' group: which edge runs which batches (ADR 0075)",
            ),
            _topic(
                topics.result_leases,
                read,
                write,
                Operation.DESCRIBE_CONFIGS,
                Operation.ALTER_CONFIGS,
                why="which edge holds which results partition; created and compacted here",
            ),
            _topics_under(
                per_request,
                read,
                Operation.CREATE,
                Operation.DELETE,
                why="per-request result topics (the `topic` topology)",
            ),
        ],
        "ingest": [
            _topic(
                topics.requests,
                read,
                why="cacheable requests from the edges; outside producers' requests",
            ),
            _topics_under(
                topics.app_requests_prefix,
                read,
                why="each outside application's own requests (ADR 0044)",
            ),
            Grant(
                Resource.GROUP,
                f"{topics.prefix}.ingest",
                Pattern.LITERAL,
                (read,),
                why="its consumer group",
            ),
            *(
                _topic(t, read, write, why="admitted requests; read back: the dedupe memory")
                for t in tiers
            ),
            _topic(
                topics.dlq,
                read,
                write,
                why="records not admitted; read back: the dedupe memory",
            ),
            *results_out("error results of refused requests; cached answers"),
            _topic(topics.cache, read, why="the response cache, read whole by every replica"),
        ],
        "scheduler": [
            *(
                _topic(t, read, write, why="the backlog; write: a dead worker's hand-backs")
                for t in tiers
            ),
            Grant(
                Resource.GROUP,
                f"{topics.prefix}.scheduler",
                Pattern.LITERAL,
                (read,),
                why="its consumer group (offsets and the ledger's metadata)",
            ),
            _topic(
                topics.batches,
                read,
                write,
                why="batches addressed to workers; read: restarts and recovery",
            ),
            _topic(topics.workers, read, why="heartbeats: free slots and liveness"),
            _topic(
                topics.variants,
                read,
                write,
                why="each model's variants and shares, read whole; write: a rollback (ADR 0058)",
            ),
            _topic(
                topics.verdicts,
                read,
                write,
                why="the canaries' verdicts, published for `tokenbus models` (ADR 0058)",
            ),
            _topic(topics.scores, read, why="shadow validation's scores (ADR 0057)"),
            _topic(
                topics.shadow,
                read,
                write,
                why="gold runs' streams (ADR 0057); read: whether one was answered already",
            ),
            _topic(topics.dlq, write, why="records it cannot read (poison)"),
            *results_out("errors of requests that expire before dispatch; resets before a re-run"),
            *results_in,  # recovery: requests already answered are not handed back
            # Recovery: one transaction writes the hand-backs and moves the dead worker's
            # group offset, under the worker's own transactional id (shared/handover.py),
            # so it writes those transactional ids and reads worker groups.
            worker_txns,
            worker_groups,
        ],
        "worker": [
            _topic(topics.batches, read, why="the batches addressed to it (its own partition)"),
            worker_groups,  # each worker commits under `<prefix>.worker.<id>`
            worker_txns,  # ...and takes its former process's batches over under that id
            _topic(topics.control, read, why="cancels"),
            _topic(topics.workers, write, why="heartbeats"),
            _topic(topics.dlq, write, why="records it cannot read (poison)"),
            *(_topic(t, write, why="a draining worker hands requests back") for t in tiers),
            *results_out("each request's stream, to its `reply_to`; resets before a hand-back"),
            *results_in,  # a take-over of a former process's batches skips what it answered
            _topic(topics.cache, write, why="complete deterministic answers (response cache)"),
            _topic(topics.scores, write, why="a gold run's score (shadow validation, ADR 0057)"),
            _topic(
                topics.shadow,
                read,
                write,
                why="gold runs' streams (ADR 0057); read: whether one was answered already",
            ),
        ],
    }


def app_grants(topics: Topics, app: str) -> list[Grant]:
    """What the outside application `app` needs (unchecked name; `app_acls` checks it)."""
    return [
        _topic(topics.app_requests(app), Operation.WRITE, why="its requests, naming it to ingest"),
        _topic(topics.app_replies(app), Operation.READ, why="its results and errors"),
        Grant(
            Resource.GROUP,
            f"{topics.app_replies(app)}.",
            Pattern.PREFIXED,
            (Operation.READ,),
            why="its own consumer groups",
        ),
    ]


def app_acls(topics: Topics, app: str, principal: str | None = None) -> list[Acl]:
    """What one outside application may do: WRITE its own requests topic (which names it to
    ingest), READ its own reply topic, and commit under its own consumer groups. Nothing on
    the shared requests topic or another application's topics (ADR 0044)."""
    if problem := app_name_problem(app):
        raise ValueError(problem)
    who = principal or f"User:{app}"
    return [
        Acl(who, g.resource, g.name, g.pattern, op, g.permission)
        for g in app_grants(topics, app)
        for op in g.operations
    ]


def service_acls(topics: Topics, principals: Mapping[str, str] | None = None) -> list[Acl]:
    """Every ACL of one deployment, for the principals of `principals` (default: per role)."""
    who = {**default_principals(), **(principals or {})}
    unknown = set(who) - set(ROLES)
    if unknown:
        raise ValueError(f"unknown roles {sorted(unknown)}; roles are {', '.join(ROLES)}")
    return [
        Acl(who[role], g.resource, g.name, g.pattern, op, g.permission)
        for role, role_grants in grants(topics).items()
        for g in role_grants
        for op in g.operations
    ]


def parse_principals(pairs: Iterable[str]) -> dict[str, str]:
    """`ROLE=PRINCIPAL` pairs (`edge=User:edge-prod`); a bare name becomes `User:<name>`."""
    parsed: dict[str, str] = {}
    for pair in pairs:
        role, sep, principal = pair.partition("=")
        if not sep or role not in ROLES or not principal:
            raise ValueError(f"--principal {pair!r}: expected ROLE=PRINCIPAL, ROLE one of {ROLES}")
        parsed[role] = principal if ":" in principal else f"User:{principal}"
    return parsed


def parse_apps(values: Iterable[str]) -> dict[str, str]:
    """`NAME` or `NAME=PRINCIPAL` (`--app billing=User:billing-prod`) -> app: principal;
    a bare name logs in as `User:<name>`."""
    parsed: dict[str, str] = {}
    for value in values:
        app, sep, principal = value.partition("=")
        if not re.fullmatch(APP_NAME, app) or (sep and not principal):
            raise ValueError(f"--app {value!r}: expected NAME or NAME=PRINCIPAL, NAME {APP_NAME}")
        if problem := app_name_problem(app):
            raise ValueError(f"--app {value!r}: {problem}")
        principal = principal or app
        principal = principal if ":" in principal else f"User:{principal}"
        if principal in default_principals().values():
            raise ValueError(f"--app {value!r}: {principal} is a service's principal")
        parsed[app] = principal
    return parsed


class AclError(Exception):
    """The broker refused to create some ACLs; the message lists which and why."""


async def create_acls(settings: TokenbusSettings, acls: Sequence[Acl]) -> None:
    """Create `acls` (existing ones are left as they are); raise `AclError` on any refusal.

    aiokafka's admin client has no ACL method: its own CreateAcls request class goes
    through the admin client's connection (`_send_request`), so the TLS and SASL login
    are those of `make_admin`. The broker picks the version (v1+: with pattern types).
    """
    admin = make_admin(settings, client_id="tokenbus-acls")
    await admin.start()
    try:
        responses = await asyncio.gather(
            *(
                admin._send_request(
                    CreateAclsRequest(
                        acl.resource,
                        acl.name,
                        acl.pattern,
                        acl.principal,
                        acl.host,
                        acl.operation,
                        acl.permission,
                    )
                )
                for acl in acls
            )
        )
    finally:
        await admin.close()
    failures = [
        f"{acl}: {for_code(code).__name__} {message or ''}".rstrip()
        for acl, response in zip(acls, responses, strict=True)
        for code, message in response.creation_responses
        if code != 0
    ]
    if failures:
        raise AclError("the broker refused these ACLs:\n  " + "\n  ".join(failures))
