"""What the frames queued for a client weigh, and the edge's budget for them (issue 37, N1).

A client's outbox (a WebSocket's `ChatSocket.outbox`, an HTTP answer's `HttpClient`) was
bounded in frames, not bytes: a delta with `logprobs: 20` is 12-183 KB as the objects the
edge queues (0.8-11 KB on the wire), so 32 sockets of one key reading slowly filled more
than the edge's 1 GiB in two minutes while every frame bound held. Each queued frame is now
weighed (`frame_weight`, an upper estimate of the objects it keeps alive, cheap: no
encoding on the result reader's path) and each client may hold `edge_outbox_bytes` of them;
all clients together hold at most the edge's budget (`budget.py`). A client past either falls
behind: it is let go and its streams wait for a resume, as one past its frames did.
"""

from __future__ import annotations

from services.edge.protocol import DeltaFrame, ServerFrame

# A frame's own weight (its object, ids, the queue entry), and per character of text.
FRAME_BYTES = 512
TEXT_BYTES_PER_CHAR = 2
# One logprob entry (a token, its logprob, the object): ~545 B in pydantic objects (the issue
# measured 183 KB for 16 tokens of 21 entries), rounded up.
LOGPROB_BYTES = 1024


def frame_weight(frame: ServerFrame) -> int:
    """An upper estimate of the memory `frame` keeps alive while it is queued."""
    if not isinstance(frame, DeltaFrame):
        return FRAME_BYTES
    entries = sum(1 + len(t.top) for t in frame.logprobs or ())
    return FRAME_BYTES + TEXT_BYTES_PER_CHAR * len(frame.text) + LOGPROB_BYTES * entries
