"""What a worker and a scheduler salvage from records they cannot handle (pure)."""

from __future__ import annotations

import json

from services.worker.intake import parse_batch
from shared.dead_letters import read_address
from shared.messages import Batch, QueuedRequest, ReplyTo, Tier

REPLY = {"topic": "t.replies", "partition": 0}


def good(request_id: str) -> dict[str, object]:
    return QueuedRequest(
        request_id=request_id,
        prompt="hello",
        tier=Tier.interactive,
        prompt_tokens=1,
        reply_to=ReplyTo.model_validate(REPLY),
    ).model_dump(mode="json")


def batch(requests: list[object], **extra: object) -> bytes:
    body = {"batch_id": "b1", "tier": "interactive", "requests": requests, "reason": "full"}
    body.update(extra)
    return json.dumps(body).encode()


def test_a_valid_batch_is_taken_whole() -> None:
    parsed = parse_batch(batch([good("a"), good("b")]))
    assert parsed.problem is None
    assert parsed.rejected == []
    assert isinstance(parsed.batch, Batch)
    assert [r.request_id for r in parsed.batch.requests] == ["a", "b"]


def test_a_partly_invalid_batch_runs_its_valid_requests_and_names_the_others() -> None:
    wrong_types = {**good("bad"), "prompt_tokens": "many"}
    surrogate = json.dumps(good("sur")).replace('"hello"', '"\\ud800"')
    raw = batch([good("a"), wrong_types, "junk", json.loads(surrogate)])
    parsed = parse_batch(raw)
    assert parsed.batch is not None
    assert [r.request_id for r in parsed.batch.requests] == ["a"]
    assert parsed.problem is not None  # the record as a whole is dead-lettered
    addressed = {r.address.request_id: r.reason for r in parsed.rejected if r.address}
    assert list(addressed) == ["bad", "sur"]  # "junk" has no address: dead-lettered only
    assert "prompt_tokens" in addressed["bad"]
    assert "JSON" in addressed["sur"]
    assert len(parsed.rejected) == 3


def test_a_batch_with_broken_fields_runs_nothing_but_answers_every_request() -> None:
    parsed = parse_batch(batch([good("a")], reason="whim"))
    assert parsed.batch is None
    assert [r.address.request_id for r in parsed.rejected if r.address] == ["a"]


def test_records_that_are_not_batches_have_nothing_to_run_or_answer() -> None:
    for raw in (
        b"not json \xff",
        b"[1, 2, 3]",
        b"[" * 50_000 + b"]" * 50_000,
        b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
        b'{"kind": "explode"}',
        b"",
    ):
        parsed = parse_batch(raw)
        assert parsed.batch is None
        assert parsed.rejected == []
        assert parsed.problem


def test_an_address_is_read_from_a_request_broken_elsewhere() -> None:
    raw = json.dumps({**good("r9"), "attempt": 2, "prompt_tokens": "x"}).encode()
    address = read_address(raw)
    assert address is not None
    assert address.request_id == "r9"
    assert address.attempt == 2
    assert address.reply_to == ReplyTo.model_validate(REPLY)
    lone = json.dumps(good("r8")).replace('"hello"', '"\\udc00"').encode()
    assert read_address(lone) is not None  # the strict parser refuses it; this one reads it
    for raw in (b"\xff", b"[1]", b"[" * 100_000, b'{"request_id": "no reply_to"}'):
        assert read_address(raw) is None
