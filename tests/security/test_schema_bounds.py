"""Issue 37, N2: a structured-output schema reaches the engine only within bounds.

Before, `response_format`, vLLM's `guided_json` / `structured_outputs.json` and a tool's
`parameters` were `dict[str, Any]` with no size, depth or branching limit, and not counted
in the prompt's bound: a 446 KB schema of nested `oneOf` passed to an engine whose grammar
compile has no timeout. Each attack below is refused where the request is validated (the
edge's frames and OpenAI bodies, ingest's records: the same models), naming the bound; the
worst schema the bounds accept compiles on the real engine within a stated time
(tests/real_engine/test_vllm_engine.py::test_the_worst_accepted_schema_compiles_in_bounded_time).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from shared.messages import ChatRequest, RequestLimits
from shared.schema_bounds import (
    MAX_BRANCHES,
    MAX_COMBINATOR_NESTING,
    MAX_COMBINATORS,
    MAX_COUNT,
    MAX_DEPTH,
    MAX_PATTERN_CHARS,
    MAX_REPEATS,
    MAX_SCHEMA_BYTES,
    schema_problem,
)
from tests.worst_schema import worst_schema


def nested_one_of(depth: int, width: int) -> dict[str, Any]:
    """The issue's attack: oneOf `depth` deep, `width` wide at every level."""
    node: dict[str, Any] = {"type": "string"}
    for level in range(depth):
        node = {"oneOf": [{**node, "title": f"b{level}_{i}"} for i in range(width)]}
    return node


def deep(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"x": node}}
    return node


def as_response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def chat(**fields: Any) -> ChatRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatRequest.model_validate(body, context={"limits": RequestLimits()})


ATTACKS: list[tuple[str, dict[str, Any], str]] = [
    ("over 400 KB of nested oneOf", nested_one_of(4, 10), "bytes, above the limit"),
    ("oneOf three deep", nested_one_of(3, 2), "nested 3 deep"),
    ("a wide oneOf", {"oneOf": [{"const": i} for i in range(MAX_BRANCHES + 1)]}, "branches"),
    (
        "many combinators",
        {"properties": {f"p{i}": {"anyOf": [{"type": "string"}]} for i in range(40)}},
        f"above the limit of {MAX_COMBINATORS}",
    ),
    ("deep nesting", deep(MAX_DEPTH), f"above the limit of {MAX_DEPTH}"),
    (
        "a recursive $ref",
        {"$defs": {"n": {"items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"},
        "cycle",
    ),
    (
        "a $ref cycle of two",
        {
            "$defs": {"a": {"items": {"$ref": "#/$defs/b"}}, "b": {"items": {"$ref": "#/$defs/a"}}},
            "$ref": "#/$defs/a",
        },
        "cycle",
    ),
    ("a remote $ref", {"$ref": "https://example.com/s.json"}, "only the schema's own"),
    ("a $ref to nothing", {"$ref": "#/$defs/missing"}, "no such definition"),
    (
        "oneOf nested through $refs",
        {
            "$defs": {
                "a": {"oneOf": [{"$ref": "#/$defs/b"}, {"type": "null"}]},
                "b": {"oneOf": [{"$ref": "#/$defs/c"}, {"type": "null"}]},
                "c": {"oneOf": [{"type": "string"}, {"type": "null"}]},
            },
            "$ref": "#/$defs/a",
        },
        "through $refs",
    ),
    ("a long pattern", {"type": "string", "pattern": "a" * (MAX_PATTERN_CHARS + 1)}, "pattern"),
    ("a huge maxItems", {"type": "array", "maxItems": 100_000}, "maxItems 100000"),
    ("a huge maxLength", {"type": "string", "maxLength": MAX_COUNT + 1}, "maxLength"),
    (
        # 12 KB: llguidance gave up on its grammar (184,320 symbols) and answered nothing.
        "many counted arrays",
        {
            "type": "object",
            "properties": {
                f"a{i}": {"type": "array", "items": {"type": "integer"}, "maxItems": MAX_COUNT}
                for i in range(180)
            },
        },
        f"adding up to {180 * MAX_COUNT}, above the limit of {MAX_REPEATS}",
    ),
]


@pytest.mark.parametrize(("schema", "says"), [a[1:] for a in ATTACKS], ids=[a[0] for a in ATTACKS])
def test_a_schema_past_a_bound_is_refused_naming_it(schema: dict[str, Any], says: str) -> None:
    problem = schema_problem(schema)
    assert problem is not None
    assert says in problem, problem
    # Wherever a request carries a schema: response_format, and a tool's parameters.
    with pytest.raises(ValidationError, match="schema: ") as caught:
        chat(response_format=as_response_format(schema))
    assert caught.value.errors()[0]["loc"][:2] == ("response_format", "json_schema")
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(ValidationError, match="schema: "):
        chat(tools=[tool])


def test_the_issues_attack_is_as_large_as_it_says() -> None:
    size = len(json.dumps(nested_one_of(4, 10)))
    assert size > 400_000, size
    assert size > MAX_SCHEMA_BYTES


def test_the_worst_accepted_schema_sits_at_every_bound() -> None:
    schema = worst_schema()
    assert schema_problem(schema) is None
    size = len(json.dumps(schema, separators=(",", ":")).encode())
    assert MAX_SCHEMA_BYTES - 1024 < size <= MAX_SCHEMA_BYTES
    assert all(len(b["anyOf"]) <= MAX_BRANCHES for b in schema["anyOf"])
    assert MAX_COMBINATOR_NESTING == 2  # anyOf of anyOf: as deep as allowed
    leaves = [leaf for branch in schema["anyOf"] for leaf in branch["anyOf"]]
    repeats = sum(leaf["properties"]["n"]["maxItems"] for leaf in leaves)
    assert MAX_REPEATS - len(leaves) < repeats <= MAX_REPEATS
    chat(response_format=as_response_format(schema))  # accepted where requests are read


def test_a_definition_counts_its_repeats_once_however_often_it_is_referred_to() -> None:
    """llguidance compiles a definition once: 256 references to an array of MAX_COUNT items
    were guided on the real engine; the same arrays written out 180 times were not."""
    leaf = {"type": "object", "properties": {"a": {"$ref": "#/$defs/big"}}, "required": ["a"]}
    schema = {
        "$defs": {"big": {"type": "array", "items": {"type": "integer"}, "maxItems": MAX_COUNT}},
        "anyOf": [{"anyOf": [leaf] * MAX_BRANCHES}] * MAX_BRANCHES,
    }
    assert schema_problem(schema) is None


def test_a_schema_is_charged_as_prompt() -> None:
    """Counted in the prompt's token bound (quotas, batch budgets) and its size limit."""
    plain = chat()
    shaped = chat(response_format=as_response_format(worst_schema()))
    assert shaped.prompt_token_bound() - plain.prompt_token_bound() >= MAX_SCHEMA_BYTES - 1024


def test_ordinary_schemas_pass() -> None:
    weather = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 100},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "array", "items": {"$ref": "#/$defs/day"}, "maxItems": 14},
        },
        "$defs": {"day": {"anyOf": [{"type": "string", "pattern": "^[0-9-]+$"}, {"type": "null"}]}},
        "required": ["city"],
    }
    assert schema_problem(weather) is None
    assert schema_problem({}) is None
