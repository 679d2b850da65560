"""The `tokenbus` command line itself: `--version`, and defaults shown by every `--help`."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version

import pytest

from tokenbus.cli import build_parser, main


def parsers(
    parser: argparse.ArgumentParser, path: str = "tokenbus"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser under `parser`, subcommands of subcommands included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def test_version_is_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"tokenbus {version('tokenbus')}\n"


def test_every_help_names_every_default() -> None:
    checked = 0
    for path, parser in parsers(build_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            default = action.default
            if default is None or isinstance(default, bool) or default == argparse.SUPPRESS:
                continue
            if not action.option_strings:
                continue
            if "default" in (action.help or "").lower():
                continue  # its help says how the default is found
            shown = f"(default: {' '.join(str(default).split())})"
            assert shown in text, f"{path} --help: {action.option_strings} lacks {shown}"
            checked += 1
    assert checked > 10  # the walk reached the subcommands' options


PROGRAM = "import sys; from tokenbus.cli import main; sys.exit(main())"


@pytest.mark.integration
def test_help_of_a_subcommand_runs_and_shows_a_default() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, "bench", "run", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"--seed SEED +\(default: \d+\)", out.stdout), out.stdout
