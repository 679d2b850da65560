"""The contract across a rolling upgrade (ADR 0072): today's schemas only widen the released
ones, today's records are valid against the released schemas as its readers apply them,
the released records read with today's readers and lose nothing, and a reader ignores a
field a newer writer added (an application's request aside, which ingest refuses).

The released contract is docs/schema/released/ (`tokenbus schema --release`); the corpus of
records is tokenbus/corpus.py, every field set.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import jsonschema
import pytest
from aiokafka import TopicPartition
from pydantic import BaseModel, TypeAdapter, ValidationError

from services.ingest.admission import Reason, Rejected, admit
from services.scheduler import scores
from services.scheduler.admission import Admission, Queue
from services.scheduler.settings import SchedulerSettings
from services.worker.intake import parse_batch
from shared.kafka import encode
from shared.messages import Heartbeat, QueuedRequest, RequestLimits, RequestRecord
from shared.records import read
from shared.topics import Topics
from tests.contract import (
    CONTRACT,
    DOCS,
    RELEASED,
    dropped,
    features_on,
    load,
    narrowed,
    reachable_models,
    read_as_today,
    released,
    released_schema,
    tolerant,
    with_unknown_fields,
)
from tests.factories import consumer_record
from tokenbus import corpus
from tokenbus.cli import main
from tokenbus.corpus import KINDS, samples
from tokenbus.schema import SCHEMAS, render

UNKNOWN = "added_later"
TP = TopicPartition("tokenbus.requests.interactive", 0)


@pytest.mark.parametrize("name", CONTRACT)
def test_no_contract_file_narrows_the_released_one(name: str) -> None:
    problems = narrowed(load(RELEASED / Path(name).name), load(DOCS / name))
    assert problems == [], (
        f"docs/{name} accepts less than the released contract: a release only adds optional"
        " fields (ADR 0072):\n" + "\n".join(problems)
    )


def _property(document: dict[str, Any], definition: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = document["$defs"][definition]["properties"][name]
    return found


def _optional(document: dict[str, Any], name: str) -> dict[str, Any]:
    """A property of the file's own schema that is `X | None`: its X."""
    found: dict[str, Any] = document["properties"][name]["anyOf"][0]
    return found


def _remove(document: dict[str, Any]) -> None:
    del document["$defs"]["ReplyTo"]["properties"]["partition"]


def _require(document: dict[str, Any]) -> None:
    document["required"].append("tenant")


def _drop_enum_value(document: dict[str, Any]) -> None:
    _property(document, "DoneResult", "finish_reason")["enum"].remove("repetition")


def _lower_max_length(document: dict[str, Any]) -> None:
    _optional(document, "client_id")["maxLength"] = 64


def _raise_minimum(document: dict[str, Any]) -> None:
    _property(document, "Usage", "prompt_tokens")["minimum"] = 1


def _integer_only(document: dict[str, Any]) -> None:
    _optional(document, "temperature")["type"] = "integer"


def _not_null(document: dict[str, Any]) -> None:
    document["properties"]["reply_to"] = {"$ref": "#/$defs/ReplyTo"}


def _drop_kind(document: dict[str, Any]) -> None:
    document["oneOf"].pop()


def _new_pattern(document: dict[str, Any]) -> None:
    _property(document, "ReplyTo", "topic")["pattern"] = r"^[a-z.]{1,249}$"


def _rename_definition(document: dict[str, Any]) -> None:
    document["$defs"]["TokenUsage"] = document["$defs"].pop("Usage")


@pytest.mark.parametrize(
    ("file", "mutate", "problem"),
    [
        ("request", _remove, "ReplyTo.partition: removed"),
        ("request", _require, "RequestRecord.tenant: newly required"),
        ("result", _drop_enum_value, "DoneResult.finish_reason: no longer takes 'repetition'"),
        ("request", _lower_max_length, "RequestRecord.client_id: maxLength 128 -> 64"),
        ("result", _raise_minimum, "Usage.prompt_tokens: minimum 0 -> 1"),
        ("request", _integer_only, "RequestRecord.temperature: no longer takes number"),
        ("request", _not_null, "RequestRecord.reply_to: no longer takes null"),
        ("result", _drop_kind, "result: no longer takes ResetResult"),
        ("request", _new_pattern, "ReplyTo.topic: pattern"),
        ("result", _rename_definition, "Usage: definition removed"),
    ],
)
def test_the_comparison_catches_each_narrowing(
    file: str, mutate: Callable[[dict[str, Any]], None], problem: str
) -> None:
    released = load(DOCS / "schema" / f"{file}.json")
    current = copy.deepcopy(released)
    mutate(current)
    problems = narrowed(released, current)
    assert any(p.startswith(problem) for p in problems), problems


def test_the_comparison_lets_a_widening_through() -> None:
    released = load(DOCS / "schema" / "result.json")
    current = copy.deepcopy(released)
    done = current["$defs"]["DoneResult"]
    done["properties"]["reasoning"] = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    done["properties"]["finish_reason"]["enum"].append("tool_calls")
    done["properties"]["seq"]["type"] = "number"  # integer -> number
    del done["properties"]["seq"]["minimum"]
    done["properties"]["model"]["anyOf"].append({"type": "integer"})
    current["$defs"]["TokenLogprob"]["properties"]["token"]["maxLength"] = 4096
    current["$defs"]["Timings"]["required"].remove("batch_size")
    assert narrowed(released, current) == []


# Payloads that are bytes, not JSON: a dead letter as read, a file's chunk as uploaded.
BYTES = frozenset({"DeadLetter", "FileChunk"})


def test_the_corpus_holds_every_kind_of_record_in_the_contract() -> None:
    payloads = {m["payload"]["$ref"].rsplit("/", 1)[-1] for m in _messages().values()}
    assert {k.payload for k in KINDS.values()} == payloads - BYTES
    for payload in payloads - BYTES:
        declared = SCHEMAS[payload][0]
        union = get_args(declared)  # Annotated[A | B, discriminator], or a model
        members = set(get_args(union[0])) if union else {declared}
        sampled = {type(s.record) for s in samples() if s.kind.payload == payload}
        assert sampled == members, f"{payload}: the corpus has {sampled}, not {members}"


def _messages() -> dict[str, Any]:
    messages: dict[str, Any] = load(DOCS / "asyncapi.yaml")["components"]["messages"]
    return messages


def test_the_corpus_sets_every_field_of_every_record_model() -> None:
    on = features_on(s.record for s in samples())
    models = reachable_models(SCHEMAS[k.payload][0] for k in KINDS.values())
    unset = sorted(
        f"{model.__name__}.{name}"
        for model in models
        for name in model.model_fields
        if name not in on.get(model, set())
    )
    assert unset == [], f"set in no record of tokenbus/corpus.py (set them there): {unset}"


def test_a_field_left_unset_is_found() -> None:
    by_kind = {s.kind.name: s.record for s in samples()}
    beat = by_kind["heartbeat"]
    nulled = beat.model_copy(update={"variant": None})
    defaulted = Heartbeat.model_validate(beat.model_dump(exclude={"queued"}))
    unwritten = by_kind["queued_request"].model_copy(update={"requeued": 0})  # exclude_if
    assert "variant" not in features_on([nulled])[Heartbeat]
    assert "queued" not in features_on([defaulted])[Heartbeat]
    assert "requeued" not in features_on([unwritten])[QueuedRequest]
    assert {"variant", "queued"} <= features_on([nulled, defaulted])[Heartbeat]


@pytest.mark.parametrize(
    "sample", [s for s in samples() if released(s.kind)], ids=lambda s: s.kind.name
)
def test_todays_records_are_valid_against_the_released_schemas(sample: corpus.Sample) -> None:
    """As the released readers apply them: a field they do not know is ignored. Ingest
    refuses one in an application's request; the next test holds for it."""
    validator = jsonschema.Draft202012Validator(tolerant(released_schema(sample.kind)))
    errors = [
        f"{list(e.absolute_path)}: {e.message[:200]}"
        for e in validator.iter_errors(json.loads(encode(sample.record)))
    ]
    assert errors == [], f"a released reader cannot read today's {sample.kind.name}"


def test_a_request_that_sets_no_new_field_is_one_the_released_ingest_takes() -> None:
    bare = RequestRecord(request_id="req-9", prompt="Hi")
    validator = jsonschema.Draft202012Validator(released_schema(KINDS["request"]))
    errors = [e.message[:200] for e in validator.iter_errors(json.loads(encode(bare)))]
    assert errors == [], (
        "a field added to the request since the release is written while unset: the released"
        " ingest would refuse every request; leave it out while unset (exclude_if, ADR 0072)"
    )


def _released_records() -> list[dict[str, Any]]:
    lines = (RELEASED / "records.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("line", _released_records(), ids=lambda line: line["kind"])
def test_released_records_read_with_todays_readers_and_lose_nothing(line: dict[str, Any]) -> None:
    kind = KINDS.get(line["kind"])
    assert kind is not None, f"the released {line['kind']} records have no reader today"
    parsed = read_as_today(kind, json.dumps(line["record"]).encode())
    assert dropped(line["record"], json.loads(encode(parsed))) == []


def test_a_record_read_back_that_lost_a_field_is_found() -> None:
    written = {"a": 1, "b": [{"c": "x", "d": 2}]}
    assert dropped(written, {"a": 1, "b": [{"c": "x", "d": 2}], "e": 3}) == []
    assert dropped(written, {"a": 1, "b": [{"c": "y"}]}) == [
        "record.b[0].c: 'x' read back as 'y'",
        "record.b[0].d: dropped",
    ]


@pytest.mark.parametrize(
    "sample", [s for s in samples() if not s.kind.strict], ids=lambda s: s.kind.name
)
def test_a_service_reader_ignores_fields_a_newer_writer_added(sample: corpus.Sample) -> None:
    newer = with_unknown_fields(sample.record, UNKNOWN)
    raw = json.dumps(newer).encode()
    assert read(sample.kind.reader, raw) == sample.record
    if released(sample.kind):  # a kind new since the release has no released reader
        released_reader = jsonschema.Draft202012Validator(tolerant(released_schema(sample.kind)))
        assert released_reader.is_valid(newer)
    # The models themselves stay strict: the unknown fields are there, at every depth.
    with pytest.raises(ValidationError) as refused:
        _strictly(sample.kind.reader, raw)
    forbidden = [e for e in refused.value.errors() if e["type"] == "extra_forbidden"]
    assert len(forbidden) == raw.count(UNKNOWN.encode())


def _strictly(reader: type[BaseModel] | TypeAdapter[Any], raw: bytes) -> object:
    if isinstance(reader, TypeAdapter):
        return reader.validate_json(raw)
    return reader.model_validate_json(raw)


def test_the_scheduler_and_the_worker_read_a_newer_writers_records() -> None:
    by_kind = {s.kind.name: s.record for s in samples()}
    newer = {
        name: json.dumps(with_unknown_fields(r, UNKNOWN)).encode() for name, r in by_kind.items()
    }
    tier = Admission(SchedulerSettings().policy_config())
    queued = tier.decide(TP, consumer_record(TP.topic, newer["queued_request"]), now=corpus.AT)
    assert isinstance(queued, Queue)
    assert queued.waiting.request == by_kind["queued_request"]
    batch = parse_batch(newer["batch"])
    assert (batch.batch, batch.problem) == (by_kind["batch"], None)
    assert scores.parse(newer["shadow_score"]) == by_kind["shadow_score"]


def test_an_applications_request_with_an_unknown_field_is_refused_by_ingest() -> None:
    request = next(s for s in samples() if s.kind.strict)
    newer = with_unknown_fields(request.record, UNKNOWN)
    assert not jsonschema.Draft202012Validator(released_schema(request.kind)).is_valid(newer)
    assert read_as_today(request.kind, encode(request.record))  # as written: admitted
    decision = admit(json.dumps(newer).encode(), None, Topics(), RequestLimits(), set())
    assert isinstance(decision, Rejected)
    assert decision.reason == Reason.invalid_field
    assert f"{UNKNOWN}: Extra inputs are not permitted" in decision.message
    assert f"reply_to.{UNKNOWN}: Extra inputs are not permitted" in decision.message


def test_release_writes_the_contract_and_todays_records(tmp_path: Path) -> None:
    assert main(["schema", "--release", "--commit", "0123abc", "--out", str(tmp_path)]) == 0
    released = tmp_path / "schema" / "released"
    for rel, text in render().items():
        assert (released / rel.name).read_text() == text
    assert (released / "records.jsonl").read_text() == corpus.lines()
    assert (released / "RELEASE").read_text().startswith("commit: 0123abc\ndate: ")
    with pytest.raises(SystemExit):
        main(["schema", "--release", "--check", "--out", str(tmp_path)])
