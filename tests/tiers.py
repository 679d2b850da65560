"""The unit tier: which tests need nothing outside the test process, and the guard that keeps
them so. `make check` runs the tier (`-m unit`), `make test` everything else (`-m "not unit"`).

A test is unit unless one of its fixtures, directly or through others, reaches outside
(`bootstrap`, the broker, under every stack, reader and producer fixture; `local_engine`,
the real model in vLLM's environment) or a mark says it starts something outside:
`integration` (a broker or cluster of its own, a Go-built tool, the compose CLI, npm, a
service process), `kafka` or `chaos`. A unit test that starts a process anyway fails at that
point, naming it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

UNIT = "unit"
# Every broker-backed fixture (stacks, readers, producers, Jaeger, the browser's stack) is
# built on `bootstrap`; tests/real_engine's on `local_engine` (vLLM's own processes).
OUTSIDE_FIXTURES = frozenset({"bootstrap", "local_engine"})
OUTSIDE_MARKS = frozenset({"integration", "kafka", "chaos"})
# The audit events (PEP 578) of starting a process: subprocess and asyncio's subprocesses
# (subprocess.Popen), os.system, os.posix_spawn, os.exec*, a fork.
PROCESS_EVENTS = frozenset(
    {"subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "os.fork", "os.forkpty"}
)


class UnitTestStartedAProcess(RuntimeError):
    """A test of the unit tier tried to start a process; it was not started."""


def is_unit(fixture_names: Iterable[str], mark_names: Iterable[str]) -> bool:
    """Whether a test with these fixtures (the whole closure, as pytest resolves it) and
    these marks belongs to the unit tier."""
    return OUTSIDE_FIXTURES.isdisjoint(fixture_names) and OUTSIDE_MARKS.isdisjoint(mark_names)


class ProcessGuard:
    """Refuses every process start while a unit test runs.

    An audit hook cannot be removed, so one is installed, on the first unit test, and it
    does nothing outside `watching`: a run without unit tests (`make test`) never has it.
    """

    def __init__(self) -> None:
        self._test: str | None = None
        self._installed = False

    @contextmanager
    def watching(self, test: str) -> Iterator[None]:
        if not self._installed:
            sys.addaudithook(self._audit)
            self._installed = True
        self._test = test
        try:
            yield
        finally:
            self._test = None

    def _audit(self, event: str, args: tuple[object, ...]) -> None:
        if self._test is None or event not in PROCESS_EVENTS:
            return
        what = repr(args[:2])[:200]
        raise UnitTestStartedAProcess(
            f"{self._test} is in the unit tier but started a process, itself or through a "
            f"library ({event} {what}); "
            "a test that needs a process, a tool or a broker is not unit: mark it "
            "@pytest.mark.integration (tests/tiers.py)"
        )
