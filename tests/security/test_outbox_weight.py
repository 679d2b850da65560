"""Issue 37, N1: what the edge queues for a slow client is bounded in weight, not only in
frames, per client and for the edge as a whole.

A delta carrying `logprobs: 20` is 12-183 KB as the objects the edge queues: 32 sockets of
one key reading 64 KiB every 15 s stayed within every frame bound and filled the edge's
1 GiB in two minutes. Here the outbox of an HTTP answer (`HttpClient`, which a WebSocket's
`ChatSocket.send` mirrors) is fed such deltas without being read.
"""

from __future__ import annotations

from services.edge.budget import ByteBudget
from services.edge.openai.routes import HttpClient
from services.edge.outbox import FRAME_BYTES, LOGPROB_BYTES, frame_weight
from services.edge.protocol import DeltaFrame, DoneFrame
from shared.messages import Timings, TokenLogprob, TopLogprob, Usage

TOP = 20


def heavy_delta(seq: int, tokens: int = 16) -> DeltaFrame:
    """A delta of `tokens` tokens, each with its 20 alternatives, as vLLM gives them."""
    top = [TopLogprob(token=f"t{i}", logprob=-1.0) for i in range(TOP)]
    logprobs = [TokenLogprob(token="tok", logprob=-0.5, top=top) for _ in range(tokens)]
    return DeltaFrame(request_id="r1", seq=seq, text="tok" * tokens, logprobs=logprobs)


def test_a_logprob_delta_weighs_what_its_objects_keep_alive() -> None:
    delta = heavy_delta(0)
    assert frame_weight(delta) >= 16 * (1 + TOP) * LOGPROB_BYTES  # ~344 KB: above 183 KB
    plain = DeltaFrame(request_id="r1", seq=0, text="hello")
    assert frame_weight(plain) < 2 * FRAME_BYTES
    done = DoneFrame(
        request_id="r1", finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1),
        timings=Timings(queue_ms=0, batch_size=1, ttft_ms=0, total_ms=0),
    )  # fmt: skip
    assert frame_weight(done) == FRAME_BYTES


def test_a_client_that_reads_nothing_falls_behind_at_its_weight_not_its_frames() -> None:
    budget = ByteBudget(1 << 30)
    client = HttpClient(max_frames=4096, max_bytes=4 << 20, budget=budget)
    sent = 0
    while not client.behind.is_set():
        client.send(heavy_delta(sent))
        sent += 1
    assert sent < 20  # ~12 deltas of ~344 KB: far below the 4,096 frames
    assert client.queued_bytes <= 4 << 20
    assert budget.held == client.queued_bytes
    client.release()
    assert budget.held == 0


def test_the_edges_budget_lets_go_of_clients_before_its_memory_is_gone() -> None:
    """32 slow sockets of 4 MiB each would hold 128 MiB; the edge's budget (here 16 MiB)
    bounds them all together: past it, the next client's frame lets that client go."""
    budget = ByteBudget(16 << 20)
    clients = [HttpClient(max_frames=4096, max_bytes=4 << 20, budget=budget) for _ in range(32)]
    for seq in range(40):
        for client in clients:
            client.send(heavy_delta(seq))
    assert budget.held <= 16 << 20
    behind = sum(c.behind.is_set() for c in clients)
    assert behind == 32  # each one let go, at its own bound or the edge's
    for client in clients:
        client.release()
    assert budget.held == 0
    # A client released (its answer over) queues nothing more.
    late = clients[0]
    late.behind.clear()
    late.send(heavy_delta(99))
    assert budget.held == 0
