"""What a subcommand module needs of the command line: the parser it registers on, and
the handler type. Apart from `tokenbus.cli` so that subcommands never import the dispatcher
that imports them."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeAlias

Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
# A subcommand's parser stores one of these as `handler`; its return is the exit code.
Handler = Callable[[argparse.Namespace], int]
