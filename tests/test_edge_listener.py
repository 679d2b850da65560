"""The WebSocket frame header the edge's gated protocol reads before a socket's key
(services/edge/ws_protocol.py), against the frames websockets itself writes (unit)."""

from __future__ import annotations

import pytest
from websockets.frames import Frame, Opcode

from services.edge.ws_protocol import frame_header


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536, 4 << 20])
@pytest.mark.parametrize("mask", [True, False])
def test_the_header_gives_where_the_payload_starts_and_its_length(size: int, mask: bool) -> None:
    frame = Frame(Opcode.TEXT, b"x" * size).serialize(mask=mask, extensions=[])
    parsed = frame_header(frame)
    assert parsed is not None
    at, length, opcode, fin = parsed
    assert (length, opcode, fin) == (size, Opcode.TEXT, True)
    assert at + length == len(frame)
    for cut in range(at):  # any part of the header alone: not whole yet
        assert frame_header(frame[:cut]) is None


def test_a_continued_message_is_told_by_fin_and_opcode() -> None:
    first = Frame(Opcode.TEXT, b"ab", fin=False).serialize(mask=True, extensions=[])
    last = Frame(Opcode.CONT, b"cd").serialize(mask=True, extensions=[])
    assert frame_header(first)[2:] == (Opcode.TEXT, False)  # type: ignore[index]
    assert frame_header(last)[2:] == (Opcode.CONT, True)  # type: ignore[index]
