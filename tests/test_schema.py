"""The published Kafka contract (tokenbus/schema.py): current, valid, and true to the code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from shared.kafka import encode
from shared.messages import (
    CancelRecord,
    DeltaResult,
    DoneResult,
    ErrorCode,
    ErrorResult,
    ReplyTo,
    RequestRecord,
    ResetResult,
    StreamResumed,
    Timings,
    Usage,
)
from shared.topics import Topics
from tests.tools import asyncapi_specs
from tokenbus.cli import main
from tokenbus.schema import channels, render

DOCS = Path(__file__).resolve().parent.parent / "docs"


def load_schema(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((DOCS / "schema" / f"{name}.json").read_text())
    return schema


def test_checked_in_contract_is_what_the_models_say() -> None:
    for rel, text in render().items():
        path = DOCS / rel
        assert path.exists(), f"{path} missing: run `tokenbus schema`"
        assert path.read_text() == text, f"{path} is stale: run `tokenbus schema`"


def test_schema_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    assert main(["schema", "--out", str(tmp_path)]) == 0
    assert main(["schema", "--out", str(tmp_path), "--check"]) == 0
    result = tmp_path / "schema" / "result.json"
    result.write_text(result.read_text().replace('"delta"', '"chunk"'))
    assert main(["schema", "--out", str(tmp_path), "--check"]) == 1


@pytest.mark.integration
def test_asyncapi_document_is_valid_against_the_official_schema() -> None:
    spec = json.loads((asyncapi_specs() / "schemas" / "3.0.0-without-$id.json").read_text())
    document = yaml.safe_load((DOCS / "asyncapi.yaml").read_text())
    validator = jsonschema.validators.validator_for(spec)(spec)
    errors = [
        f"{list(e.absolute_path)}: {e.message[:200]}" for e in validator.iter_errors(document)
    ]
    assert errors == []
    # The validator does look: an AsyncAPI 2 verb is refused.
    document["operations"]["edgeSendsRequests"]["action"] = "publish"
    assert not validator.is_valid(document)


def test_asyncapi_covers_every_topic_with_senders_and_receivers() -> None:
    document = yaml.safe_load((DOCS / "asyncapi.yaml").read_text())
    addresses = {c["address"] for c in document["channels"].values()}
    topics = Topics()
    assert set(topics.partitions()) <= addresses
    assert topics.request_results("{request_id}") in addresses
    for ch in channels(topics):
        assert ch.sends, ch.name
        operations = [
            op for op in document["operations"].values() if op["channel"]["$ref"].endswith(ch.name)
        ]
        for service in ch.sends:
            assert {"action": "send", "tag": service} in [
                {"action": op["action"], "tag": op["tags"][0]["name"]} for op in operations
            ], (ch.name, service)
    request = document["components"]["messages"]["request"]
    assert request["bindings"]["kafka"]["key"]["description"] == "request_id (UTF-8)."
    assert set(request["headers"]["properties"]) == {"traceparent", "tracestate"}


def valid(name: str, value: bytes | dict[str, Any]) -> bool:
    record = json.loads(value) if isinstance(value, bytes) else value
    validator = jsonschema.Draft202012Validator(load_schema(name))
    return bool(validator.is_valid(record))


def test_records_tokenbus_writes_satisfy_the_published_schemas() -> None:
    request = RequestRecord(
        request_id="r-1",
        tenant="acme",
        messages=[{"role": "user", "content": "hi"}],  # type: ignore[list-item]
        reply_to=ReplyTo(topic="tokenbus.replies.acme"),
    )
    assert valid("request", encode(request))
    assert valid("request", {"request_id": "r-2", "prompt": "hello"})  # an external minimum
    assert not valid("request", {"request_id": "r 3!", "prompt": "hello"})
    assert not valid("request", {"request_id": "r-4", "prompt": "hi", "temperature": 9})
    assert not valid("request", {"request_id": "r-5", "prompt": "hi", "colour": "red"})

    timings = Timings(queue_ms=1, batch_size=2, ttft_ms=3, total_ms=4)
    for result in (
        DeltaResult(request_id="r-1", seq=0, text="He"),
        DoneResult(
            request_id="r-1",
            seq=1,
            finish_reason="stop",
            usage=Usage(prompt_tokens=1, completion_tokens=1),
            timings=timings,
        ),
        ErrorResult(request_id="r-1", seq=0, code=ErrorCode.overloaded, message="busy"),
        ResetResult(request_id="r-1", seq=0, attempt=1),
    ):
        assert valid("result", encode(result)), result
    assert not valid("result", {"kind": "chunk", "request_id": "r-1", "seq": 0, "text": "x"})

    assert valid("control", encode(CancelRecord(request_id="r-1", reason="disconnect")))
    assert valid("control", encode(StreamResumed(request_id="r-1", edge_id="edge-a")))
    assert not valid("control", {"kind": "cancel", "request_id": "r-1", "reason": "bored"})


@pytest.mark.parametrize("name", ["request", "result", "control"])
def test_json_schemas_are_valid_draft_2020_12(name: str) -> None:
    jsonschema.Draft202012Validator.check_schema(load_schema(name))
