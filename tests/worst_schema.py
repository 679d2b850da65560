"""The costliest structured-output schema shared/schema_bounds.py accepts, to compile on the
real engine (tests/real_engine/test_vllm_engine.py) and to check the bounds against
(tests/security/test_schema_bounds.py): anyOf/oneOf nested as deep as allowed, every one
as wide as allowed, leaves with the longest counted repetitions and patterns, within the
byte limit."""

from __future__ import annotations

import json
from typing import Any

from shared.schema_bounds import MAX_BRANCHES, MAX_COUNT, MAX_SCHEMA_BYTES


def leaf(i: int, j: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            f"k{i}_{j}": {"type": "string", "maxLength": MAX_COUNT, "pattern": "^[a-z]+$"},
            "n": {"type": "array", "items": {"type": "integer"}, "maxItems": MAX_COUNT},
        },
        "required": [f"k{i}_{j}"],
    }


def worst_schema() -> dict[str, Any]:
    """Two levels of anyOf (xgrammar refuses oneOf), MAX_BRANCHES wide each, as many
    leaves as fit the bytes."""
    outer: list[dict[str, Any]] = []
    for i in range(MAX_BRANCHES):
        inner = [leaf(i, j) for j in range(MAX_BRANCHES)]
        outer.append({"anyOf": inner})
        schema = {"anyOf": outer}
        while len(json.dumps(schema, separators=(",", ":")).encode()) > MAX_SCHEMA_BYTES:
            inner.pop()
        if len(inner) < MAX_BRANCHES:
            break
    return {"anyOf": outer}
