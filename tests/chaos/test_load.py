"""The planned load: replayable from its seed, near its rates, every prompt its own text."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.chaos.availability import Sample
from tests.chaos.load import KafkaRequest, KafkaRequester, LoadRun, Planned, WsUser, plan_load
from tests.chaos.openai_load import sse_events


def test_the_same_seed_plans_the_same_load() -> None:
    rate = {"websocket": 20.0, "kafka": 10.0}
    assert plan_load(5, rate, 60) == plan_load(5, rate, 60)
    assert plan_load(5, rate, 60) != plan_load(6, rate, 60)


def test_arrivals_are_in_time_order_near_the_rates_and_distinct() -> None:
    planned = plan_load(11, {"websocket": 20.0, "kafka": 10.0}, 60)
    assert [p.at_s for p in planned] == sorted(p.at_s for p in planned)
    assert all(0 <= p.at_s < 60 for p in planned)
    ws = sum(p.channel == "websocket" for p in planned)
    kafka = sum(p.channel == "kafka" for p in planned)
    assert 1000 <= ws <= 1400  # Poisson, mean 1200
    assert 480 <= kafka <= 720  # mean 600
    assert len({p.prompt for p in planned}) == len(planned)
    texts = {p.expected_text for p in planned[:50]}
    assert len(texts) == 50  # the sim text depends on the prompt: each answer is its own


@pytest.fixture
async def idle_app() -> AsyncIterator[KafkaRequester]:
    """A requester never started: the test files its requests and records by hand."""
    app = KafkaRequester("127.0.0.1:1", "requests", "replies", 1, "t")
    yield app
    await app.stop()


async def test_samples_time_each_request_from_the_load_zero(idle_app: KafkaRequester) -> None:
    ws = [Planned(1.0, "websocket", f"w{i}", 8, "interactive") for i in range(3)]
    kafka = [Planned(2.0, "kafka", f"k{i}", 8, "interactive") for i in range(3)]
    user = WsUser("u0", ["ws://127.0.0.1:1/"], 0, print)
    app = idle_app
    run = LoadRun([user], app, [*ws, *kafka])
    with pytest.raises(RuntimeError, match="before send_all"):
        run.samples()
    now = time.monotonic()
    run.zero = now - 10.0
    for p in ws:
        user.submit(p)
    answered, unsent, refused = user.requests.values()
    answered.sent, answered.sent_at = True, now - 0.5  # as `_write` stamps it
    refused.sent, refused.sent_at = True, now - 0.2
    accepted = {"type": "chat.accepted", "client_id": answered.client_id, "request_id": "r0"}
    delta = {"type": "chat.delta", "request_id": "r0", "seq": 0, "text": "a"}
    no_socket: Any = None  # only a refused resume's retry would write to it
    user._on_frame(no_socket, accepted | {"resume_token": "t0"})
    user._on_frame(no_socket, delta)
    first_token_at = answered.first_token_at
    for frame in (
        {"type": "chat.reset", "request_id": "r0", "attempt": 1},
        delta,
        {"type": "chat.done", "request_id": "r0"},
        {"type": "error", "client_id": refused.client_id, "code": "overloaded"},
    ):
        user._on_frame(no_socket, frame)
    assert first_token_at is not None
    assert answered.first_token_at == first_token_at  # the first delta ever, reset or not
    done, failed = KafkaRequest(kafka[0], "k0"), KafkaRequest(kafka[1], "k1")
    for request in (done, failed):
        request.sent_at, request.acked = now - 1.0, True
        app.requests[request.request_id] = request
    done.read({"kind": "delta", "attempt": 0, "seq": 0, "text": "a"}, now - 0.25)
    done.read({"kind": "done", "attempt": 0, "seq": 1}, now)
    failed.read({"kind": "error", "attempt": 0, "seq": 0, "code": "internal"}, now)

    samples = run.samples()

    assert len(samples) == len(run.planned)
    assert [s.sent_at_s for s in samples] == sorted(s.sent_at_s for s in samples)
    ws_samples = [s for s in samples if s.channel == "websocket"]
    assert ws_samples[0] == Sample("websocket", 1.0, None, False, False)  # never sent
    assert ws_samples[1].sent_at_s == pytest.approx(9.5)
    assert (ws_samples[1].accepted, ws_samples[1].answered) == (True, True)
    assert ws_samples[1].final_code == "done"
    ttft = ws_samples[1].ttft_s  # to the first delta ever, the reset's attempt aside
    assert ttft is not None
    assert 0.5 <= ttft < 5.0
    assert answered.accepted_at is not None
    assert answered.final_at is not None
    assert ws_samples[2].sent_at_s == pytest.approx(9.8)
    assert ws_samples[2:] == [
        Sample("websocket", ws_samples[2].sent_at_s, None, False, False, "overloaded")
    ]
    assert unsent.sent_at is None
    kafka_samples = [s for s in samples if s.channel == "kafka"]
    assert [(s.accepted, s.answered, s.final_code, s.ttft_s) for s in kafka_samples] == [
        (False, False, None, None),  # never handed to the app: offered at 2.0 s
        (True, True, "done", pytest.approx(0.75)),
        (True, False, "internal", None),
    ]
    assert kafka_samples[1].sent_at_s == pytest.approx(9.0)
    assert (done.first_token_at, done.final_at) == (now - 0.25, now)


def test_the_splice_gap_runs_from_the_lost_attempts_last_record_to_new_text() -> None:
    planned = Planned(0.0, "kafka", "p", 8, "interactive")
    r = KafkaRequest(planned, "k1")

    def record(kind: str, attempt: int, seq: int, text: str = "") -> dict[str, Any]:
        return {"request_id": "k1", "kind": kind, "attempt": attempt, "seq": seq, "text": text}

    r.read(record("delta", 0, 0, "The "), 1.0)
    r.read(record("delta", 0, 1, "bus "), 1.5)  # then its worker dies
    r.read(record("reset", 1, 0), 3.0)
    r.read(record("delta", 1, 0, "The bus "), 3.2)  # the text so far: nothing new yet
    r.read(record("delta", 1, 1, "leaves."), 4.0)
    r.read(record("done", 1, 2), 4.1)
    assert r.splice_gaps() == [4.0 - 1.5]


async def test_sse_events_are_read_with_their_ids_and_keep_alives_skipped() -> None:
    async def lines() -> AsyncIterator[str]:
        for line in [": keep-alive", "", "id: 0:-1", 'data: {"a": 1}', "", "data: [DONE]", ""]:
            yield line

    assert [e async for e in sse_events(lines())] == [("0:-1", '{"a": 1}'), (None, "[DONE]")]


def test_a_re_run_of_an_attempt_that_sent_no_text_is_no_splice() -> None:
    r = KafkaRequest(Planned(0.0, "kafka", "p", 8, "interactive"), "k1")
    r.read({"request_id": "k1", "kind": "delta", "attempt": 1, "seq": 0, "text": "The"}, 9.0)
    r.read({"request_id": "k1", "kind": "done", "attempt": 1, "seq": 1}, 9.5)
    assert r.splice_gaps() == []
