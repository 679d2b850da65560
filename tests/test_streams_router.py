"""Framing rules of the edge's StreamRouter, with plain values: what a client is shown."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.edge.protocol import ServerFrame
from services.edge.streams import ResultStream, ResumePoint, StreamRouter
from shared.messages import (
    DeltaResult,
    DoneResult,
    ErrorCode,
    ErrorResult,
    ResetResult,
    Timings,
    Usage,
)

RID = "r1"


def delta(seq: int, attempt: int = 0, text: str | None = None) -> DeltaResult:
    return DeltaResult(request_id=RID, attempt=attempt, seq=seq, text=text or f"a{attempt}s{seq} ")


def done(seq: int, attempt: int = 0) -> DoneResult:
    return DoneResult(
        request_id=RID,
        attempt=attempt,
        seq=seq,
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=seq),
        timings=Timings(queue_ms=0, batch_size=1, ttft_ms=1, total_ms=2),
    )


class Client:
    """What one socket receives."""

    def __init__(self) -> None:
        self.frames: list[ServerFrame] = []

    def send(self, frame: ServerFrame, stream: ResultStream | None = None) -> None:
        self.frames.append(frame)

    @property
    def kinds(self) -> list[str]:
        return [f.type for f in self.frames]

    def shown(self) -> list[tuple[int, int]]:
        """(attempt, seq) of every delta shown, the attempt taken from the last reset."""
        attempt, out = 0, []
        for f in self.frames:
            if f.type == "chat.reset":
                attempt = f.attempt
            elif f.type == "chat.delta":
                out.append((attempt, f.seq))
        return out


def accepted_router(ended: list[ResultStream] | None = None) -> tuple[StreamRouter, Client]:
    router = StreamRouter(on_end=(ended.append if ended is not None else None))
    client = Client()
    router.open(RID, client)
    router.release(RID, _accepted())
    return router, client


def _accepted() -> ServerFrame:
    from services.edge.protocol import AcceptedFrame
    from shared.messages import Tier

    return AcceptedFrame(request_id=RID, resume_token="t", tier=Tier.interactive)


def test_duplicates_are_shown_once() -> None:
    router, client = accepted_router()
    for record in [delta(0), delta(1), delta(0), delta(1), delta(2), delta(2)]:
        router.route(record)
    assert client.shown() == [(0, 0), (0, 1), (0, 2)]


def test_new_attempt_is_announced_and_old_attempt_is_never_shown_again() -> None:
    router, client = accepted_router()
    router.route(delta(0))
    router.route(delta(1))
    assert router.route(delta(0, attempt=1))
    assert not router.route(delta(2, attempt=0))  # the old attempt's late record
    router.route(delta(1, attempt=1))
    router.route(done(2, attempt=1))
    assert client.kinds == [
        "chat.accepted",
        "chat.delta",
        "chat.delta",
        "chat.reset",
        "chat.delta",
        "chat.delta",
        "chat.done",
    ]
    assert client.shown() == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_an_attempt_a_cascade_declined_is_charged_beside_the_final_once() -> None:
    router, client = accepted_router()
    [stream] = list(router)
    router.route(delta(0))
    declined = Usage(prompt_tokens=5, completion_tokens=40)
    reset = ResetResult(request_id=RID, attempt=1, reason="escalated: refusal", usage=declined)
    assert not router.route(reset)  # it shows nothing by itself
    assert not router.route(reset)  # read twice (a replay): counted once
    assert stream.spent is None  # no final yet: the charge stands as admitted
    router.route(delta(0, attempt=1))
    router.route(done(1, attempt=1))  # usage: 1 prompt token, 1 completion token
    assert stream.spent == Usage(prompt_tokens=6, completion_tokens=41)
    assert client.kinds[-3:] == ["chat.reset", "chat.delta", "chat.done"]
    # A reset of a fault (a worker declared dead) carries no usage: nothing more is charged.
    router2, _ = accepted_router()
    [other] = list(router2)
    router2.route(ResetResult(request_id=RID, attempt=1, reason="worker dead"))
    router2.route(done(0, attempt=1))
    assert other.spent == Usage(prompt_tokens=1, completion_tokens=0)


def test_records_before_acceptance_wait_behind_it() -> None:
    router = StreamRouter()
    client = Client()
    router.open(RID, client)
    router.route(delta(0))
    router.route(done(1))
    assert client.frames == []
    router.release(RID, _accepted())
    assert client.kinds == ["chat.accepted", "chat.delta", "chat.done"]
    assert router.get(RID) is None


def test_a_gap_ends_the_stream_with_an_error_not_a_jump() -> None:
    ended: list[ResultStream] = []
    router, client = accepted_router(ended)
    router.route(delta(0))
    assert not router.route(delta(2))
    assert not router.route(delta(3))
    assert client.kinds == ["chat.accepted", "chat.delta", "error"]
    assert client.frames[-1].code == ErrorCode.not_found  # type: ignore[union-attr]
    assert [s.request_id for s in ended] == [RID]


def test_final_record_ends_the_stream_once() -> None:
    ended: list[ResultStream] = []
    router, client = accepted_router(ended)
    router.route(delta(0))
    router.route(ErrorResult(request_id=RID, seq=1, code=ErrorCode.cancelled, message="c"))
    router.route(ErrorResult(request_id=RID, seq=1, code=ErrorCode.cancelled, message="c"))
    assert client.kinds == ["chat.accepted", "chat.delta", "error"]
    assert len(ended) == 1
    assert len(router) == 0


def test_the_variant_that_answered_is_named_only_where_the_stream_may_know_it() -> None:
    """Issue 37, N7: a rollout's canary is not named to the tenants it serves (they could
    find its answers and fail them); a request that pinned its variant is told it."""
    canary = done(0).model_copy(update={"variant": "canary"})
    shown = {}
    for names_variant in (False, True):
        router, client = StreamRouter(), Client()
        router.open(RID, client, names_variant=names_variant)
        router.release(RID, _accepted())
        router.route(canary)
        [final] = [f for f in client.frames if f.type == "chat.done"]
        shown[names_variant] = final.variant
    assert shown == {False: None, True: "canary"}


def test_a_detached_stream_shows_nothing_but_still_learns_it_ended() -> None:
    ended: list[ResultStream] = []
    router, client = accepted_router(ended)
    router.route(delta(0))
    assert [s.request_id for s in router.detach(client)] == [RID]
    stream = router.get(RID)
    assert stream is not None
    assert stream.detached
    router.route(delta(1))
    router.route(done(2))
    assert client.kinds == ["chat.accepted", "chat.delta"]
    assert [s.request_id for s in ended] == [RID]


def test_resume_shows_only_what_follows_after_seq_once_caught_up() -> None:
    router = StreamRouter()
    client = Client()
    router.resume(RID, client, ResumePoint(attempt=0, after_seq=1))
    for record in [delta(0), delta(1), delta(2)]:  # the replay from the token's offset
        router.route(record)
    assert client.frames == []
    assert router.caught_up(RID)
    router.route(delta(3))
    assert client.kinds == ["stream.resumed", "chat.delta", "chat.delta"]
    assert client.shown() == [(0, 2), (0, 3)]


def test_resume_of_a_superseded_attempt_gets_the_reset_and_the_new_attempt() -> None:
    router = StreamRouter()
    client = Client()
    router.resume(RID, client, ResumePoint(attempt=0, after_seq=2))
    for record in [delta(0), delta(1), delta(2), delta(3), delta(0, 1), delta(4), delta(1, 1)]:
        router.route(record)
    assert router.caught_up(RID)
    assert client.kinds == [
        "stream.resumed",
        "chat.delta",
        "chat.reset",
        "chat.delta",
        "chat.delta",
    ]
    assert client.shown() == [(0, 3), (1, 0), (1, 1)]


def test_resume_claiming_more_than_the_log_holds_is_refused() -> None:
    router = StreamRouter()
    client = Client()
    router.resume(RID, client, ResumePoint(attempt=0, after_seq=5))
    router.route(delta(0))
    router.route(delta(1))
    assert not router.caught_up(RID)
    assert client.kinds == ["error"]
    assert client.frames[0].code == ErrorCode.invalid_request  # type: ignore[union-attr]
    assert router.get(RID) is None


@st.composite
def result_logs(draw: st.DrawFn) -> list[DeltaResult]:
    """A log as Kafka may hold it: attempts in order, each a prefix of deltas, replayed bits."""
    log: list[DeltaResult] = []
    for attempt in range(draw(st.integers(1, 3))):
        n = draw(st.integers(0, 6))
        records = [delta(i, attempt) for i in range(n)]
        for _ in range(draw(st.integers(0, 3))):  # duplicates inserted after their original
            if records:
                i = draw(st.integers(0, len(records) - 1))
                at = draw(st.integers(i + 1, len(records)))
                records.insert(at, records[i])
        log.extend(records)
    return log


@given(result_logs())
def test_any_log_is_shown_without_duplicates_and_in_order_within_each_attempt(
    log: list[DeltaResult],
) -> None:
    router, client = accepted_router()
    for record in log:
        router.route(record)
    shown = client.shown()
    assert len(shown) == len(set(shown))
    for a in {a for a, _ in shown}:
        seqs = [s for att, s in shown if att == a]
        assert seqs == list(range(len(seqs)))
    attempts = [a for a, _ in shown]
    assert attempts == sorted(attempts)
