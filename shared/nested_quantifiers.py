"""Whether a regular expression repeats a repeat: the shape that backtracks catastrophically.

`(a+)+`, `(\\w*\\s?)*` and `(x{1,9})+` let one text split between the two repeats in
exponentially many ways; on a text that almost matches, a backtracking engine tries every
one. An operator's verifier pattern is searched in answers a tenant steers (issue 37, N9), so
such a pattern is refused where the configuration is read, before any answer reaches it. The
search's timeout (services/worker/verifiers.py) stays the second guard, for the ambiguous
patterns this check does not catch (overlapping alternatives such as `(a|aa)+`).

A repeat is variable when its bounds differ (`+`, `*`, `{1,9}`; not `?`, not `{3}`). A
variable repeat inside another repeat of more than one is refused, unless either cannot be
backtracked into: a possessive repeat (`a++`) or an atomic group (`(?>...)`).

Read with Python's own `re` parser (`re._parser`, the one `re.compile` uses): a pattern it
cannot read is refused too, as the verifier reads patterns "as Python's `re` reads them".
"""

from __future__ import annotations

import re
from re import _constants as c  # type: ignore[attr-defined]
from re import _parser  # type: ignore[attr-defined]
from typing import Any

_REPEATS = (c.MAX_REPEAT, c.MIN_REPEAT)


def nested_quantifier(pattern: str) -> str | None:
    """Why `pattern` is refused (a repeat of a repeat, or unreadable), or None."""
    try:
        parsed = _parser.parse(pattern)
    except re.error as exc:
        return f"not a pattern Python's re reads: {exc}"
    if _nests(parsed, inside=False):
        return (
            "a repeated part holds a repeat of its own (as `(a+)+` does), which backtracks"
            " catastrophically; make one of them possessive (`a++`) or atomic (`(?>...)`),"
            " or drop one"
        )
    return None


def _nests(items: Any, inside: bool) -> bool:
    """Whether a variable repeat lies in `items` under a repeat (`inside`: already under one)."""
    for op, av in items:
        if op in _REPEATS:
            low, high, body = av
            if inside and high > 1 and high != low:
                return True
            if _nests(body, inside or high > 1):
                return True
        elif any(_nests(part, under) for part, under in _parts(op, av, inside)):
            return True
    return False


def _parts(op: Any, av: Any, inside: bool) -> list[tuple[Any, bool]]:
    """The sub-patterns of a node that is not a plain repeat, each with its `inside`."""
    if op is c.POSSESSIVE_REPEAT:
        return [(av[2], False)]  # not backtracked into: a fresh start
    if op is c.ATOMIC_GROUP:
        return [(av, False)]
    if op is c.SUBPATTERN:
        return [(av[3], inside)]
    if op is c.BRANCH:
        return [(branch, inside) for branch in av[1]]
    if op in (c.ASSERT, c.ASSERT_NOT):
        return [(av[1], inside)]
    if op is c.GROUPREF_EXISTS:
        return [(part, inside) for part in av[1:] if part is not None]
    return []
