"""`tokenbus acls`: what each process may read and write in Kafka, as the README's "what runs
where" table, generated from the ACL grants (`tokenbus.acls.grants`) so the two cannot drift."""

from __future__ import annotations

import argparse
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING

from shared.topics import Topics
from tokenbus.acls import ROLES, Grant, Pattern, Permission, Resource, app_grants, grants
from tokenbus.marked import with_block

if TYPE_CHECKING:
    from tokenbus.commands import Subcommands

BLOCK = "acl-table"
APP = "<app>"  # an outside application's name, as the table shows it

_KINDS = {
    Resource.TOPIC: "",
    Resource.GROUP: "group ",
    Resource.TRANSACTIONAL_ID: "transactional ids ",
}


def _name(grant: Grant) -> str:
    star = "*" if grant.pattern is Pattern.PREFIXED else ""
    return f"`{grant.name}{star}`"


def _may(grant: Grant) -> str:
    ops = ", ".join(op.name.lower().replace("_", " ") for op in grant.operations)
    return f"**never** {ops}" if grant.permission is Permission.DENY else ops


def _rows(who: str, role_grants: list[Grant]) -> list[str]:
    """One row per run of grants that differ only in the resource's name."""
    rows = []

    def same(g: Grant) -> tuple[object, ...]:
        return (g.resource, g.operations, g.permission, g.why)

    for _, run in groupby(role_grants, key=same):
        run_grants = list(run)
        first = run_grants[0]
        names = ", ".join(_name(g) for g in run_grants)
        what = f"{_KINDS[first.resource]}{names}"
        why = first.why.replace("|", "\\|")
        rows.append(f"| {who} | {what} | {_may(first)} | {why} |")
        who = ""
    return rows


def markdown_table(topics: Topics | None = None) -> str:
    """Every process's (and an outside application's) Kafka permissions, with their reasons."""
    topics = topics or Topics()
    by_role = grants(topics)
    lines = ["| process | topics and groups | may | why |", "|---|---|---|---|"]
    for role in ROLES:
        lines += _rows(f"{role} (`services/{role}`)", by_role[role])
    lines += _rows(f"an outside application `{APP}` (ADR 0044)", app_grants(topics, APP))
    return "\n".join(lines)


def with_table(readme: str) -> str:
    """The README text with its "what runs where" block replaced by the current table."""
    return with_block(readme, BLOCK, markdown_table())


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "acls", help="print what each process may read and write, as a Markdown table"
    )
    parser.add_argument(
        "--update", metavar="README", type=Path, help="rewrite the table block in this file"
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    if args.update is None:
        print(markdown_table())
        return 0
    path: Path = args.update
    path.write_text(with_table(path.read_text()))
    print(f'updated the "what runs where" table in {path}')
    return 0
