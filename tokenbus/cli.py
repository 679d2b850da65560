"""`tokenbus` command line: a dispatcher; each subcommand lives in its own module."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib.metadata import version
from typing import Any

from tokenbus import (
    acl_table,
    batch_cli,
    bench,
    config,
    eval_cli,
    kafka,
    keys,
    models_cli,
    schema,
    topics,
    trace,
    up,
)
from tokenbus.commands import Handler


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` names each option's default, except where there is none to name (unset,
    a flag that is off, or a help text that names it already)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Every parser of the command line, subcommands included (`add_subparsers` makes its
    parsers of the class of the parser it is called on): defaults shown in `--help`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        formatter: type[argparse.HelpFormatter] = kwargs.get(
            "formatter_class", argparse.HelpFormatter
        )
        if not issubclass(formatter, DefaultsShown):
            # A subcommand's own formatter (raw description, …) keeps its behaviour.
            formatter = type(f"{formatter.__name__}WithDefaults", (DefaultsShown, formatter), {})
        kwargs["formatter_class"] = formatter
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        # An option without help text is shown bare; its default still deserves a line.
        shows = action.default is not None and not isinstance(action.default, bool)
        if action.help is None and action.option_strings and shows:
            action.help = "(default: %(default)s)"
        return action


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = Parser(
        prog="tokenbus", description="LLM serving decoupled by Apache Kafka."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('tokenbus')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # A new subcommand is a module with `register(commands)` and one entry here.
    for register in (
        up.register,
        kafka.register,
        topics.register,
        bench.register,
        trace.register,
        config.register,
        acl_table.register,
        keys.register,
        models_cli.register,
        eval_cli.register,
        schema.register,
        batch_cli.register,
    ):
        register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return handler(args)
