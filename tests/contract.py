"""The parts of the contract check (tests/test_contract_compat.py, ADR 0072): where a schema
accepts less than the released one did, which fields a corpus of records sets, and how
today's readers read a record.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel

from services.ingest.admission import Admitted, admit
from shared.messages import RequestLimits
from shared.records import read
from shared.topics import Topics
from tokenbus.corpus import Kind
from tokenbus.schema import JSON_SCHEMAS, SCHEMAS

Schema = Mapping[str, Any]

DOCS = Path(__file__).resolve().parent.parent / "docs"
RELEASED = DOCS / "schema" / "released"
# The contract's files, each as `tokenbus schema` writes it under docs/ and `--release`
# copies it under docs/schema/released/.
CONTRACT = ("schema/request.json", "schema/result.json", "schema/control.json", "asyncapi.yaml")

# Bounds a narrowing lowers (the upper ones) or raises (the lower ones); added where there
# was none, either narrows too.
_UPPER = ("maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum")
_LOWER = ("minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum")
# Keywords whose change cannot be told wider or narrower: any change narrows.
_EXACT = ("pattern", "format")


def load(path: Path) -> dict[str, Any]:
    """A contract file: JSON Schema, or the AsyncAPI document (YAML)."""
    text = path.read_text()
    loaded: dict[str, Any] = yaml.safe_load(text) if path.suffix == ".yaml" else json.loads(text)
    return loaded


def definitions(document: Schema) -> dict[str, Schema]:
    """Every named schema of a contract file: the AsyncAPI document's component schemas, or a
    JSON Schema's own (named by its title) and its `$defs`."""
    if "components" in document:
        return dict(document["components"]["schemas"])
    own = {k: v for k, v in document.items() if k != "$defs"}
    return {document["title"]: own, **document.get("$defs", {})}


def narrowed(released: Schema, current: Schema) -> list[str]:
    """Where the current contract file accepts less than the released one: a definition or
    property removed (a rename is a removal), a property newly required, a type, an enum, a
    union or a bound narrowed. One line each, naming the definition and the property."""
    old, new = definitions(released), definitions(current)
    found = [f"{name}: definition removed" for name in old if name not in new]
    for name in sorted(old.keys() & new.keys()):
        found += narrowings(old[name], new[name], name)
    return found


def narrowings(old: Schema, new: Schema, where: str) -> list[str]:
    """How `new` accepts less than `old`; `where` names the place in the messages."""
    found: list[str] = []
    choices = _alternatives(new)
    for alternative in _alternatives(old):
        match = next((c for c in choices if _takes(c, alternative)), None)
        if match is None:
            found.append(f"{where}: no longer takes {_described(alternative)}")
        else:
            found += _narrowed(alternative, match, where)
    return found


def _alternatives(node: Schema) -> list[Schema]:
    listed = node.get("anyOf") or node.get("oneOf")
    return list(listed) if listed else [node]


def _types(node: Schema) -> set[str]:
    kind = node.get("type")
    return set(kind) if isinstance(kind, list) else {kind} if kind else set()


def _takes(new: Schema, old: Schema) -> bool:
    """Whether alternative `new` is the same kind of value as `old`, or a wider one."""
    if "$ref" in old or "$ref" in new:
        return old.get("$ref", "").rsplit("/", 1)[-1] == new.get("$ref", "").rsplit("/", 1)[-1]
    old_types, new_types = _types(old), _types(new)
    if not new_types:
        return True  # any value: narrower only by its own keywords (compared next)
    if "integer" in old_types and "number" in new_types:
        old_types = (old_types - {"integer"}) | {"number"}
    return bool(old_types) and old_types <= new_types


def _described(node: Schema) -> str:
    if "$ref" in node:
        return str(node["$ref"].rsplit("/", 1)[-1])
    if "const" in node:
        return repr(node["const"])
    return " or ".join(sorted(_types(node))) or "any value"


def _narrowed(old: Schema, new: Schema, where: str) -> list[str]:
    """Narrowings of one alternative against the one that takes its place."""
    found = [f"{where}: {problem}" for problem in _values_narrowed(old, new)]
    found += _properties_narrowed(old, new, where)
    if "items" in old or "items" in new:
        found += narrowings(old.get("items", {}), new.get("items", {}), f"{where}[]")
    # A tuple's positions; one it gains or loses is a bound (minItems, maxItems) too.
    places = zip(old.get("prefixItems", ()), new.get("prefixItems", ()), strict=False)
    for i, (was, now) in enumerate(places):
        found += narrowings(was, now, f"{where}[{i}]")
    return found


def _values_narrowed(old: Schema, new: Schema) -> Iterator[str]:
    now, was = _listed(new), _listed(old)
    if now is not None and was is None:
        yield f"now only {now}"
    elif now is not None and was is not None:
        yield from (f"no longer takes {v!r}" for v in was if v not in now)
    for bound in _UPPER:
        if bound in new and new[bound] < old.get(bound, float("inf")):
            yield f"{bound} {old.get(bound, 'none')} -> {new[bound]}"
    for bound in _LOWER:
        if bound in new and new[bound] > old.get(bound, float("-inf")):
            yield f"{bound} {old.get(bound, 'none')} -> {new[bound]}"
    for keyword in _EXACT:
        if keyword in new and new[keyword] != old.get(keyword):
            yield f"{keyword} {old.get(keyword)!r} -> {new[keyword]!r}"
    if new.get("uniqueItems") and not old.get("uniqueItems"):
        yield "items now unique"


def _listed(node: Schema) -> list[Any] | None:
    """The only values a node takes (`enum`, `const`), or None where it names none."""
    if "enum" in node:
        return list(node["enum"])
    return [node["const"]] if "const" in node else None


def _properties_narrowed(old: Schema, new: Schema, where: str) -> list[str]:
    found: list[str] = []
    was, now = old.get("properties", {}), new.get("properties", {})
    for name in was:
        if name not in now:
            found.append(f"{where}.{name}: removed")
        else:
            found += narrowings(was[name], now[name], f"{where}.{name}")
    required = set(old.get("required", ()))
    found += [f"{where}.{n}: newly required" for n in new.get("required", ()) if n not in required]
    others_was = old.get("additionalProperties", True)
    others_now = new.get("additionalProperties", True)
    if others_now is False and others_was is not False:
        found.append(f"{where}: no longer takes properties it does not name")
    elif isinstance(others_was, dict) and isinstance(others_now, dict):
        found += narrowings(others_was, others_now, f"{where}{{}}")
    return found


def tolerant(schema: Any) -> Any:
    """The schema as a reader that ignores unknown fields applies it: every
    `additionalProperties: false` gone."""
    if isinstance(schema, dict):
        return {
            k: tolerant(v)
            for k, v in schema.items()
            if not (k == "additionalProperties" and v is False)
        }
    if isinstance(schema, list):
        return [tolerant(v) for v in schema]
    return schema


def released(kind: Kind) -> bool:
    """Whether the released contract has `kind` (a kind added since has no released reader)."""
    return kind.payload in load(RELEASED / "asyncapi.yaml")["components"]["schemas"]


def released_schema(kind: Kind) -> dict[str, Any]:
    """The released JSON Schema of `kind`: its file under docs/schema/released/ where it has
    one, else its AsyncAPI component."""
    files = {
        component: name
        for name, (model, mode, _) in JSON_SCHEMAS.items()
        for component, (other, other_mode) in SCHEMAS.items()
        if other is model and other_mode == mode
    }
    if kind.payload in files:
        return load(RELEASED / f"{files[kind.payload]}.json")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$ref": f"#/components/schemas/{kind.payload}",
        "components": load(RELEASED / "asyncapi.yaml")["components"],
    }


def read_as_today(kind: Kind, raw: bytes) -> BaseModel:
    """A record of `kind` as today's reader parses it: an application's request by ingest's
    admission (strict), every other kind through shared/records.py. Raises AssertionError
    naming why a request is refused."""
    if kind.strict:
        decision = admit(raw, None, Topics(), RequestLimits(), set())
        assert isinstance(decision, Admitted), getattr(decision, "message", decision)
        return decision.request
    parsed = read(kind.reader, raw)
    assert isinstance(parsed, BaseModel)
    return parsed


def _written(instance: BaseModel, name: str) -> str:
    info = type(instance).model_fields[name]
    return info.serialization_alias or info.alias or name


def _models(value: object, dumped: object) -> Iterator[tuple[BaseModel, dict[str, Any]]]:
    if isinstance(value, BaseModel) and isinstance(dumped, dict):
        yield value, dumped
        for name in type(value).model_fields:
            yield from _models(getattr(value, name), dumped.get(_written(value, name)))
    elif isinstance(value, list | tuple) and isinstance(dumped, list):
        for item, item_dumped in zip(value, dumped, strict=True):
            yield from _models(item, item_dumped)


def features_on(records: Iterable[BaseModel]) -> dict[type[BaseModel], set[str]]:
    """Per model class in `records`, the fields some record sets: given when it was built,
    not None, and written."""
    on: dict[type[BaseModel], set[str]] = {}
    for record in records:
        for model, dumped in _models(record, record.model_dump(mode="json")):
            on.setdefault(type(model), set()).update(
                name
                for name in type(model).model_fields
                if name in model.model_fields_set
                and getattr(model, name) is not None
                and _written(model, name) in dumped
            )
    return on


def reachable_models(roots: Iterable[object]) -> set[type[BaseModel]]:
    """Every model class a record of these types (models, or unions of them) can hold."""
    found: set[type[BaseModel]] = set()
    todo = list(roots)
    while todo:
        kind = todo.pop()
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            if kind not in found:
                found.add(kind)
                todo += [info.annotation for info in kind.model_fields.values()]
        else:
            todo += get_args(kind)
    return found


def with_unknown_fields(record: BaseModel, name: str) -> dict[str, Any]:
    """The record as a newer writer may write it: a field `name` added to it and to every
    model in it."""
    dumped = record.model_dump(mode="json")
    for _, written in _models(record, dumped):
        written[name] = {"added": "by a newer release"}
    return dumped


def dropped(written: object, read_back: object, where: str = "record") -> list[str]:
    """Where `read_back` lost or changed what `written` held (fields it added are fine)."""
    if isinstance(written, dict) and isinstance(read_back, dict):
        return [
            problem
            for key, value in written.items()
            for problem in (
                dropped(value, read_back[key], f"{where}.{key}")
                if key in read_back
                else [f"{where}.{key}: dropped"]
            )
        ]
    if isinstance(written, list) and isinstance(read_back, list) and len(written) == len(read_back):
        return [
            problem
            for i, (was, now) in enumerate(zip(written, read_back, strict=True))
            for problem in dropped(was, now, f"{where}[{i}]")
        ]
    return [] if written == read_back else [f"{where}: {written!r} read back as {read_back!r}"]
