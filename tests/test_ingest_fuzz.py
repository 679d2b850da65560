"""Hypothesis fuzzing of ingest's pure admission: whatever a record holds, `admit` decides.

Raw bytes, recursive JSON (with lone surrogates, NaN, huge numbers, deep nesting) and
records shaped like the schema with each field drawn from good and bad values: `admit`
never raises; an admitted request is a tier record every service can read back; a
rejection's message, error result and DLQ headers are encodable and carry no input value.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from services.ingest.admission import (
    MAX_MESSAGE_CHARS,
    Admitted,
    Decision,
    Duplicate,
    RecentIds,
    Rejected,
    admit,
    reserved_topics,
)
from shared.dead_letters import FRAMING_BYTES, ReplyStatus, Source
from shared.kafka import encode
from shared.messages import ErrorResult, QueuedRequest, RequestLimits
from shared.topics import Topics

TOPICS = Topics("tb")
LIMITS = RequestLimits(max_prompt_chars=2000, max_request_tokens=3000)
MAX_RECORD = 20_000
# Put only in values, never in field names: no rejection may repeat it.
SECRET = "SECRET-7f3a9c"

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | any_text
    | st.just(SECRET)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=20,
)
request_ids = st.from_regex(r"\A[A-Za-z0-9._:-]{1,20}\Z") | json_values
topics = st.sampled_from(["tb.results", "mine", "tb.requests", "tb.batches", ".", "bad topic"])
reply_tos = st.fixed_dictionaries(
    {"topic": topics | json_values},
    optional={"partition": st.integers(-2, 20) | json_values},
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "wizard"]), "content": any_text | json_values}
    ),
    max_size=3,
)
record_fields: dict[str, st.SearchStrategy[Any]] = {
    "request_id": request_ids,
    "prompt": any_text | st.text(max_size=3000) | json_values,
    "messages": messages | json_values,
    "max_tokens": st.integers(-5, 5000) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-1, 2) | json_values,
    "stop": st.lists(any_text, max_size=5) | json_values,
    "priority": st.sampled_from(["interactive", "background", "urgent"]) | json_values,
    "deadline_ms": st.integers(-5, 2**40) | json_values,
    "tenant": st.text(max_size=200) | json_values,
    "reply_to": reply_tos | json_values,
    "created_at": st.floats(allow_nan=True, allow_infinity=True) | json_values,
    "client_id": any_text | json_values,
    SECRET.lower(): json_values,  # an unknown field (its name may be quoted, that is fine)
}
records = st.fixed_dictionaries({}, optional=record_fields)


def as_bytes(value: object, ascii_only: bool) -> bytes:
    # ensure_ascii escapes a lone surrogate as \udXXX; otherwise it goes out as raw bytes.
    text = json.dumps(value, ensure_ascii=ascii_only, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


def check(decision: Decision, raw: bytes) -> None:
    """What every decision must satisfy for the shell to act on it without failing."""
    if isinstance(decision, Duplicate):
        return
    if isinstance(decision, Admitted):
        assert len(decision.value) <= MAX_RECORD
        back = QueuedRequest.model_validate_json(decision.value)
        assert back == decision.request
        assert decision.topic in TOPICS.tiers
        assert back.reply_to.topic not in reserved_topics(TOPICS)
        deadline = back.deadline_at
        assert deadline is None or math.isfinite(deadline)
        assert math.isfinite(back.created_at)
        return
    assert isinstance(decision, Rejected)
    assert 0 < len(decision.message) <= MAX_MESSAGE_CHARS
    assert SECRET not in decision.message
    decision.message.encode()  # strict UTF-8: no lone surrogate
    error = decision.error_result()
    if error is not None:
        assert ErrorResult.model_validate_json(encode(error)) == error
    letter = decision.dead_letter(
        raw,
        b"k",
        Source("tb.requests", 0, 1),
        ReplyStatus.none,
        None,
        max_record_bytes=MAX_RECORD,
        reader="ingest:fuzz",
    )
    for name, text in letter.headers.items():
        name.encode()
        text.encode()
    size = len(letter.value) + sum(len(k) + len(v.encode()) for k, v in letter.headers.items())
    assert size <= MAX_RECORD - FRAMING_BYTES


def decide(raw: bytes, key: bytes | None) -> Decision:
    return admit(raw, key, TOPICS, LIMITS, RecentIds(), max_record_bytes=MAX_RECORD)


@FUZZ
@given(raw=st.binary(max_size=3000), key=st.none() | st.binary(max_size=50))
def test_any_bytes_get_a_decision(raw: bytes, key: bytes | None) -> None:
    check(decide(raw, key), raw)


@FUZZ
@given(value=json_values, ascii_only=st.booleans(), key=st.none() | st.binary(max_size=20))
def test_any_json_gets_a_decision(value: object, ascii_only: bool, key: bytes | None) -> None:
    raw = as_bytes(value, ascii_only)
    check(decide(raw, key), raw)


@FUZZ
@given(record=records, ascii_only=st.booleans(), key=st.none() | st.binary(max_size=20))
def test_any_record_shaped_input_gets_a_decision(
    record: dict[str, Any], ascii_only: bool, key: bytes | None
) -> None:
    raw = as_bytes(record, ascii_only)
    check(decide(raw, key), raw)


@FUZZ
@given(depth=st.integers(1, 20_000), opener=st.sampled_from([b"[", b'{"a":']))
def test_nesting_of_any_depth_gets_a_decision(depth: int, opener: bytes) -> None:
    closer = b"]" if opener == b"[" else b"}"
    raw = b'{"request_id": "r1", "prompt": ' + opener * depth + b"1" + closer * depth + b"}"
    decision = decide(raw, None)
    assert isinstance(decision, Rejected)
    check(decision, raw)


def test_the_record_generator_reaches_admission_too() -> None:
    """Without this, the properties above could hold only because nothing was ever admitted."""
    # The same field strategies, with a prompt and a reply_to always drawn and no unknown
    # field: a search over `records` itself can miss (every drawn field must be valid at once).
    with_reply = st.fixed_dictionaries(
        {"prompt": any_text, "reply_to": reply_tos},
        optional={
            k: v
            for k, v in record_fields.items()
            if k not in ("prompt", "messages", "reply_to", SECRET.lower())
        },
    )
    found = find(
        with_reply,
        lambda r: isinstance(decide(as_bytes(r, True), None), Admitted),
        settings=settings(max_examples=5000, deadline=None),
    )
    check(decide(as_bytes(found, True), None), as_bytes(found, True))
