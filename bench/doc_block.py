"""The generated blocks of docs/benchmarks.md: each benchmark rewrites its own, in place."""

from __future__ import annotations

from pathlib import Path


def replace_block(doc: Path, begin: str, end: str, block: str) -> None:
    """Put `block` (from its `begin` marker to its `end` marker) where `doc` has that block;
    appended where it has none, the file created where it is missing."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
