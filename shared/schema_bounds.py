"""The bounds a structured-output schema must keep before an engine compiles it (issue 37, N2).

A JSON schema in `response_format`, vLLM's `guided_json` / `structured_outputs.json`, or a
tool's `parameters` becomes a grammar inside the engine (xgrammar on vLLM), and the compile
has no timeout: its time grows with the schema's size, and super-exponentially with nested
`oneOf`/`anyOf` (vllm-project/vllm#54003), and a counted repetition (`maxItems: 100000`) is
unrolled. One request could then hold an engine core for minutes or hours. Every schema a
tenant sends is checked here first, where the request enters (the edge, ingest), and refused
with the limit it breaks:

- its JSON text at most `MAX_SCHEMA_BYTES`, nested at most `MAX_DEPTH` containers deep;
- `anyOf` / `oneOf` / `allOf`: at most `MAX_BRANCHES` branches each, `MAX_COMBINATORS` in
  all, and one inside another's branch at most `MAX_COMBINATOR_NESTING` deep;
- `$ref` only to the schema's own `#/$defs/...` (or `#/definitions/...`), never in a cycle
  (a recursive schema is an unbounded grammar);
- `pattern` (and `patternProperties`' keys) at most `MAX_PATTERN_CHARS`, valid for Python's `re`;
- `minLength`/`maxLength`, `minItems`/`maxItems`, `minProperties`/`maxProperties`,
  `minContains`/`maxContains` at most `MAX_COUNT`;
- the arrays' and objects' counts (each node's largest of `REPEATS`, a definition counted
  once however often it is referred to) at most `MAX_REPEATS` in all: llguidance unrolls
  each such count into grammar symbols and gives up past 65,525 of them (its matcher
  fails, the answer is empty: ADR 0069), where a string's length is its lexer's and costs
  no symbol. Measured on the real engine: 61,440 counted items guided, 184,320 gave up.

The worst schema these bounds accept is compiled on the real engine by
tests/real_engine/test_vllm_engine.py, whose time docs/security.md records.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

MAX_SCHEMA_BYTES = 32 * 1024
MAX_DEPTH = 24  # JSON containers: about ten levels of nested object schemas
MAX_BRANCHES = 16
MAX_COMBINATORS = 32
MAX_COMBINATOR_NESTING = 2
MAX_PATTERN_CHARS = 512
MAX_COUNT = 1024
MAX_REPEATS = 16 * 1024

COMBINATORS = ("anyOf", "oneOf", "allOf")
COUNTS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
# Counts of an array's items or an object's members: unrolled into a grammar's symbols.
REPEATS = ("minItems", "maxItems", "minProperties", "maxProperties", "minContains", "maxContains")
_LOCAL_REF = re.compile(r"^#/(\$defs|definitions)/([^/]+)$")


def schema_problem(schema: object) -> str | None:
    """Why an engine should not compile `schema`, naming the bound it breaks; None if none."""
    try:
        size = len(json.dumps(schema, separators=(",", ":")).encode())
    except (ValueError, TypeError, RecursionError):
        return "not JSON, or nested past any bound"
    if size > MAX_SCHEMA_BYTES:
        return f"{size} bytes, above the limit of {MAX_SCHEMA_BYTES}"
    if (depth := _depth(schema)) > MAX_DEPTH:
        return f"nested {depth} deep, above the limit of {MAX_DEPTH}"
    combinators = repeats = 0
    for node in _nodes(schema):
        repeats += max((_count(node.get(key)) for key in REPEATS), default=0)
        for key in COMBINATORS:
            branches = node.get(key)
            if branches is None:
                continue
            combinators += 1
            if isinstance(branches, list) and len(branches) > MAX_BRANCHES:
                return f"{key} of {len(branches)} branches, above the limit of {MAX_BRANCHES}"
        if problem := _node_problem(node):
            return problem
    if combinators > MAX_COMBINATORS:
        return f"{combinators} anyOf/oneOf/allOf, above the limit of {MAX_COMBINATORS}"
    if repeats > MAX_REPEATS:
        return (
            f"array and object counts (maxItems, minItems, ...) adding up to {repeats},"
            f" above the limit of {MAX_REPEATS}"
        )
    if problem := _ref_problem(schema):
        return problem
    nesting = _combinator_nesting(schema, _definitions(schema), {})
    if nesting > MAX_COMBINATOR_NESTING:
        return (
            f"anyOf/oneOf/allOf nested {nesting} deep (through $refs too), above the limit"
            f" of {MAX_COMBINATOR_NESTING}"
        )
    return None


def _count(value: object) -> int:
    """A count keyword's value as a number of repetitions (0: not a count)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return int(value)
    return 0


def _node_problem(node: dict[str, Any]) -> str | None:
    for key in COUNTS:
        value = node.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > MAX_COUNT:
            return f"{key} {value}, above the limit of {MAX_COUNT}"
    patterns = [node.get("pattern")]
    if isinstance(props := node.get("patternProperties"), dict):
        patterns += list(props)
    for pattern in patterns:
        if not isinstance(pattern, str):
            continue
        if len(pattern) > MAX_PATTERN_CHARS:
            return f"a pattern of {len(pattern)} characters, above the limit of {MAX_PATTERN_CHARS}"
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as exc:
            return f"a pattern that is not a valid regular expression ({exc})"
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and _LOCAL_REF.match(ref)):
        return f"$ref {str(ref)[:80]!r}: only the schema's own #/$defs/NAME may be referred to"
    return None


def _definitions(schema: object) -> dict[str, object]:
    """The schema's own definitions, by the `$ref` that names each."""
    defs: dict[str, object] = {}
    if isinstance(schema, dict):
        for section in ("$defs", "definitions"):
            if isinstance(found := schema.get(section), dict):
                defs.update({f"#/{section}/{name}": body for name, body in found.items()})
    return defs


def _combinator_nesting(value: object, defs: dict[str, object], memo: dict[str, int]) -> int:
    """The most anyOf/oneOf/allOf nested in one another on a path through `value`, a `$ref`
    counting as its definition (acyclic: `_ref_problem` checked). Recursive, within the
    depth `MAX_DEPTH` bounds."""
    if isinstance(value, list):
        return max((_combinator_nesting(v, defs, memo) for v in value), default=0)
    if not isinstance(value, dict):
        return 0
    deepest = 0
    ref = value.get("$ref")
    if isinstance(ref, str) and ref in defs:
        if ref not in memo:
            memo[ref] = 0  # acyclic, so never read before it is set below
            memo[ref] = _combinator_nesting(defs[ref], defs, memo)
        deepest = memo[ref]
    for key, child in value.items():
        if key in ("$defs", "definitions"):
            continue  # counted where they are referred to
        inner = _combinator_nesting(child, defs, memo)
        deepest = max(deepest, inner + 1 if key in COMBINATORS else inner)
    return deepest


def _ref_problem(schema: object) -> str | None:
    """A `$ref` to a definition the schema lacks, or definitions that refer in a cycle."""
    if not isinstance(schema, dict):
        return None
    defs = _definitions(schema)
    refers = {name: set(_refs(body)) for name, body in defs.items()}
    for ref in _refs(schema):
        if ref not in defs:
            return f"$ref {ref[:80]!r}: no such definition"
    # A cycle among the definitions: depth-first, with the path on a stack.
    done: set[str] = set()
    for start in refers:
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(refers[start]))]
        on_path = {start}
        while stack:
            name, rest = stack[-1]
            nxt = next(rest, None)
            if nxt is None:
                stack.pop()
                on_path.discard(name)
                done.add(name)
                continue
            if nxt in on_path:
                names = [n.rsplit("/", 1)[-1] for n, _ in stack] + [nxt.rsplit("/", 1)[-1]]
                return f"$ref cycle {' -> '.join(names)}: a recursive schema"
            if nxt not in done and nxt in refers:
                on_path.add(nxt)
                stack.append((nxt, iter(refers[nxt])))
    return None


def _refs(value: object) -> Iterator[str]:
    for node in _nodes(value):
        if isinstance(ref := node.get("$ref"), str):
            yield ref


def _nodes(value: object) -> Iterator[dict[str, Any]]:
    """Every object in `value`."""
    stack: list[object] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _depth(value: object) -> int:
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            depth += 1
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth) for child in children)
    return deepest
