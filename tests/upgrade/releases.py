"""The source tree of another release, to run beside this checkout's in a rolling upgrade."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

from tests.stack import ROOT

TREES = ROOT / ".tokenbus" / "upgrade" / "trees"
RELEASED = ROOT / "docs" / "schema" / "released" / "RELEASE"


def previous_release() -> str:
    """The commit `docs/schema/released/` was copied from (`tokenbus schema --release`):
    the release the contract-compatibility check holds this one to."""
    found = re.search(r"^commit: ([0-9a-f]{40})$", RELEASED.read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{RELEASED} names no commit")
    return found.group(1)


def commit_of(rev: str) -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"no commit {rev!r} in this clone: {done.stderr.strip()}")
    return done.stdout.strip()


def source_tree(commit: str) -> Path:
    """`commit`'s files under .tokenbus/upgrade/trees/ (`git archive`, once per commit)."""
    tree = TREES / commit
    if (tree / ".complete").exists():
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    with subprocess.Popen(["git", "archive", commit], cwd=ROOT, stdout=subprocess.PIPE) as archive:
        subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {commit} failed")
    (tree / ".complete").touch()
    return tree


def dependencies_differ(commit: str) -> bool:
    """Whether `commit` needs a dependency this checkout does not pin as it does: both
    releases run in this checkout's environment, so such a pair is not what a user would
    run. A dependency this checkout adds is no difference (the older release runs beside a
    package it does not import)."""
    shown = subprocess.run(
        ["git", "show", f"{commit}:pyproject.toml"], cwd=ROOT, capture_output=True, check=True
    )
    theirs = tomllib.loads(shown.stdout.decode())["project"]["dependencies"]
    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return not set(theirs) <= set(ours)


def says_it_leaves(tree: Path) -> bool:
    """Whether the release in `tree` has a drained worker say it leaves, and its schedulers
    read that (`LEAVING_HEADER`)."""
    return "LEAVING_HEADER" in (tree / "shared" / "messages.py").read_text()
