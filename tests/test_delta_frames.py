"""`DeltaFrames` writes each chunk's record byte for byte as pydantic's `encode` would."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.kafka import encode
from shared.messages import DeltaFrames, DeltaResult

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


def test_the_framing_is_validated_once_by_the_model_itself() -> None:
    with pytest.raises(ValueError, match="request_id"):
        DeltaFrames("not an id!", 0)
    with pytest.raises(ValueError, match="attempt"):
        DeltaFrames("r1", -1)
    with pytest.raises(ValueError, match="seq"):
        DeltaFrames("r1", 0).encode(-1, "x")
