"""`tokenbus` command line: a dispatcher; each subcommand lives in its own module."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from tokenbus import bench, config, kafka, keys, topics, trace, up
from tokenbus.commands import Handler


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenbus", description="LLM serving decoupled by Apache Kafka."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # A new subcommand is a module with `register(commands)` and one entry here.
    for register in (
        up.register,
        kafka.register,
        topics.register,
        bench.register,
        trace.register,
        config.register,
        keys.register,
    ):
        register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return handler(args)
