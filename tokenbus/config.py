"""`tokenbus config`: every setting of every process, as the README's configuration table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import AliasChoices
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

if TYPE_CHECKING:
    from tokenbus.commands import Subcommands


def _groups() -> list[tuple[str, type[BaseSettings], type[BaseSettings] | None]]:
    from services.edge.settings import EdgeSettings
    from services.ingest.settings import IngestSettings
    from services.scheduler.settings import SchedulerSettings
    from services.worker.settings import WorkerSettings
    from shared.settings import TokenbusSettings
    from shared.telemetry import TelemetrySettings
    from tokenbus.up import UpSettings

    return [
        ("every service", TokenbusSettings, None),
        ("telemetry (every service)", TelemetrySettings, None),
        ("edge", EdgeSettings, TokenbusSettings),
        ("ingest", IngestSettings, TokenbusSettings),
        ("scheduler", SchedulerSettings, TokenbusSettings),
        ("worker", WorkerSettings, TokenbusSettings),
        ("tokenbus up", UpSettings, TokenbusSettings),
    ]


def env_name(name: str, field: FieldInfo, prefix: str = "TOKENBUS_") -> str:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return " / ".join(str(a) for a in alias.choices)
    if isinstance(alias, str):
        return alias
    return prefix + name.upper()


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return "(computed)"
    value = field.default
    if value is None:
        return "unset"
    if hasattr(value, "value"):
        value = value.value
    return f"`{value}`"


def markdown_table() -> str:
    lines = ["| variable | process | default | meaning |", "|---|---|---|---|"]
    seen: set[str] = set()
    for group, cls, base in _groups():
        inherited = set(base.model_fields) if base else set()
        for name, field in cls.model_fields.items():
            if name in inherited:
                continue
            env = env_name(name, field)
            if env in seen:
                continue  # `up` repeats the edge's host and port
            seen.add(env)
            meaning = (field.description or "").replace("|", "\\|")
            lines.append(f"| `{env}` | {group} | {_default(field)} | {meaning} |")
    return "\n".join(lines)


START = "<!-- config-table:start -->"
END = "<!-- config-table:end -->"


def with_table(readme: str) -> str:
    """The README text with its configuration block replaced by the current table."""
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{markdown_table()}\n{END}{tail}"


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("config", help="print every setting as a Markdown table")
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
    print(f"updated the configuration table in {path}")
    return 0
