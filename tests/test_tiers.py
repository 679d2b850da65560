"""The test tiers (tests/tiers.py): which tests are unit, and the guard that keeps them so."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import pytest

from tests.tiers import UNIT, UnitTestStartedAProcess, is_unit


@pytest.mark.parametrize(
    ("fixtures", "marks", "unit"),
    [
        (("request", "tmp_path"), (), True),
        (("request", "bootstrap", "stack"), (), False),
        (("local_engine",), (), False),
        (("tmp_path",), ("integration",), False),
        (("tmp_path",), ("kafka",), False),
        (("tmp_path",), ("chaos",), False),
        (("tmp_path",), ("parametrize", "timeout"), True),
    ],
)
def test_a_test_is_unit_unless_a_fixture_or_a_mark_reaches_outside(
    fixtures: tuple[str, ...], marks: tuple[str, ...], unit: bool
) -> None:
    assert is_unit(fixtures, marks) is unit


def test_this_test_is_marked_unit(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker(UNIT) is not None


def test_a_unit_test_cannot_start_a_process(request: pytest.FixtureRequest) -> None:
    named = re.escape(request.node.nodeid)
    with pytest.raises(UnitTestStartedAProcess, match=named):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(UnitTestStartedAProcess, match=named):
        os.system("true")


async def test_a_unit_test_cannot_start_an_asyncio_subprocess(
    request: pytest.FixtureRequest,
) -> None:
    with pytest.raises(UnitTestStartedAProcess, match=re.escape(request.node.nodeid)):
        await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
