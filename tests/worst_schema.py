"""The costliest structured-output schema shared/schema_bounds.py accepts, to compile on the
real engine (tests/real_engine/test_vllm_engine.py) and to check the bounds against
(tests/security/test_schema_bounds.py): anyOf/oneOf nested as deep as allowed, every one
as wide as allowed, leaves with the longest counted repetitions and patterns, within the
byte limit."""

from __future__ import annotations

import json
from typing import Any

from shared.schema_bounds import MAX_BRANCHES, MAX_COUNT, MAX_REPEATS, MAX_SCHEMA_BYTES


def leaf(i: int, j: int, items: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            f"k{i}_{j}": {"type": "string", "maxLength": MAX_COUNT, "pattern": "^[a-z]+$"},
            "n": {"type": "array", "items": {"type": "integer"}, "maxItems": items},
        },
        "required": [f"k{i}_{j}"],
    }


def worst_schema() -> dict[str, Any]:
    """Two levels of anyOf (xgrammar refuses oneOf), MAX_BRANCHES wide each, as many
    leaves as fit the bytes, their arrays' maxItems sharing MAX_REPEATS out evenly."""
    outer: list[list[tuple[int, int]]] = []
    for i in range(MAX_BRANCHES):
        inner = [(i, j) for j in range(MAX_BRANCHES)]
        outer.append(inner)
        while len(_encoded(outer, MAX_COUNT)) > MAX_SCHEMA_BYTES:
            inner.pop()
        if len(inner) < MAX_BRANCHES:
            break
    leaves = sum(len(inner) for inner in outer)
    return _schema(outer, min(MAX_COUNT, MAX_REPEATS // leaves))


def _schema(outer: list[list[tuple[int, int]]], items: int) -> dict[str, Any]:
    return {"anyOf": [{"anyOf": [leaf(i, j, items) for i, j in inner]} for inner in outer]}


def _encoded(outer: list[list[tuple[int, int]]], items: int) -> bytes:
    return json.dumps(_schema(outer, items), separators=(",", ":")).encode()
