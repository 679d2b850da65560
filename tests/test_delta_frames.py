"""`DeltaFrames` writes each chunk's record byte for byte as pydantic's `encode` would."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.kafka import encode
from shared.messages import DeltaFrames, DeltaResult, TokenLogprob, TopLogprob

IDS = st.from_regex(r"\A[A-Za-z0-9._:-]{1,128}\Z")
# Any text an engine may stream (lone surrogates cannot be UTF-8 encoded by either).
TEXTS = st.text(st.characters(exclude_categories=["Cs"]))


@given(request_id=IDS, attempt=st.integers(0, 10**6), seq=st.integers(0, 10**9), text=TEXTS)
def test_frames_are_pydantics_bytes(request_id: str, attempt: int, seq: int, text: str) -> None:
    frames = DeltaFrames(request_id, attempt)
    record = DeltaResult(request_id=request_id, attempt=attempt, seq=seq, text=text)
    assert frames.encode(seq, text) == encode(record)


@pytest.mark.parametrize(
    "text", ['"', "\\", "\n\r\t\b\f", "\x00\x01\x1f\x7f", "é 🙂 \u2028 \ufeff"]
)
def test_escapes_match(text: str) -> None:
    assert DeltaFrames("r1", 2).encode(3, text) == encode(
        DeltaResult(request_id="r1", attempt=2, seq=3, text=text)
    )


LOGPROBS = st.lists(
    st.builds(
        TokenLogprob,
        token=TEXTS.filter(lambda t: len(t) <= 1024),
        logprob=st.floats(-9999.0, 0.0),
        top=st.lists(
            st.builds(TopLogprob, token=st.text(max_size=8), logprob=st.floats(-9999.0, 0.0)),
            max_size=3,
        ),
    ),
    max_size=4,
)


@given(text=TEXTS, logprobs=LOGPROBS)
def test_frames_with_logprobs_are_pydantics_bytes(text: str, logprobs: list[TokenLogprob]) -> None:
    record = DeltaResult(request_id="r1", attempt=1, seq=2, text=text, logprobs=logprobs)
    assert DeltaFrames("r1", 1).encode(2, text, logprobs) == encode(record)
    assert DeltaResult.model_validate_json(encode(record)) == record


COUNTS = st.none() | st.integers(0, 10**6)


@given(text=TEXTS, logprobs=st.none() | LOGPROBS, tokens=COUNTS, prompt_tokens=COUNTS)
def test_frames_with_token_counts_are_pydantics_bytes(
    text: str, logprobs: list[TokenLogprob] | None, tokens: int | None, prompt_tokens: int | None
) -> None:
    record = DeltaResult(
        request_id="r1",
        attempt=0,
        seq=5,
        text=text,
        logprobs=logprobs,
        tokens=tokens,
        prompt_tokens=prompt_tokens,
    )
    assert DeltaFrames("r1", 0).encode(5, text, logprobs, tokens, prompt_tokens) == encode(record)
    assert DeltaResult.model_validate_json(encode(record)) == record


def test_unset_logprobs_stay_out_of_the_record() -> None:
    # A reader from before logprobs (its models forbid unknown fields) still reads it.
    assert b"logprobs" not in encode(DeltaResult(request_id="r1", seq=0, text="x"))
    assert b"logprobs" not in DeltaFrames("r1", 0).encode(0, "x")


def test_the_framing_is_validated_once_by_the_model_itself() -> None:
    with pytest.raises(ValueError, match="request_id"):
        DeltaFrames("not an id!", 0)
    with pytest.raises(ValueError, match="attempt"):
        DeltaFrames("r1", -1)
    with pytest.raises(ValueError, match="seq"):
        DeltaFrames("r1", 0).encode(-1, "x")
