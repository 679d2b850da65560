"""Generated blocks in Markdown files: the text between `<!-- NAME:start -->` and
`<!-- NAME:end -->` is rewritten by a command, and a test fails when it is stale."""

from __future__ import annotations


class MissingBlock(ValueError):
    """The file lacks the block's start or end marker (or has them out of order)."""


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of the block `name`."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def with_block(text: str, name: str, body: str) -> str:
    """`text` with the block `name` holding `body` (one line break either side)."""
    start, end = markers(name)
    head, found, rest = text.partition(start)
    if not found:
        raise MissingBlock(f"no {start} marker: add {start} and {end} where the block goes")
    _, found, tail = rest.partition(end)
    if not found:
        raise MissingBlock(f"no {end} marker after {start}")
    return f"{head}{start}\n{body}\n{end}{tail}"
