"""A lost attempt's next one continues the answer: what the edge shows (ADR 0071).

The worker of a continuing attempt writes the answer's text so far as its first delta, then
what it generates. The edge shows only what extends what its client was shown: no
`chat.reset`, no text twice, `seq` counting on under the attempt the client knows. An
attempt that starts over instead (its first delta does not begin with the text shown) is
shown as before: `chat.reset`, then its own text.
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from services.edge.openai.translate import Answer, SseStream
from services.edge.protocol import ServerFrame
from services.edge.streams import ResultStream, ResumePoint, StreamRouter
from shared.messages import (
    DeltaResult,
    ErrorCode,
    ErrorResult,
    ResetResult,
    TokenLogprob,
)
from tests.test_openai_translate import CHAT
from tests.test_streams_router import RID, Client, accepted_router, done


def said(seq: int, text: str, attempt: int = 0) -> DeltaResult:
    return DeltaResult(request_id=RID, attempt=attempt, seq=seq, text=text)


def reset(attempt: int) -> ResetResult:
    return ResetResult(request_id=RID, attempt=attempt, reason="the worker was declared dead")


def texts(client: Client) -> str:
    """The answer as a client that clears it at each `chat.reset` has it."""
    out: list[str] = []
    for frame in client.frames:
        if frame.type == "chat.reset":
            out.clear()
        elif frame.type == "chat.delta":
            out.append(frame.text)  # type: ignore[union-attr]
    return "".join(out)


LOST_AFTER_TWO = [said(0, "The bus"), said(1, " leaves"), reset(1)]


def test_a_continuation_shows_only_the_new_text_under_the_same_attempt() -> None:
    router, client = accepted_router()
    for record in [*LOST_AFTER_TWO, said(0, "The bus leaves", 1), said(1, " when", 1)]:
        router.route(record)
    router.route(done(2, attempt=1))
    assert client.kinds == ["chat.accepted", *["chat.delta"] * 3, "chat.done"]
    assert client.shown() == [(0, 0), (0, 1), (0, 2)]
    assert texts(client) == "The bus leaves when"


def test_a_continuation_of_more_than_the_client_was_shown_shows_the_rest_of_it() -> None:
    # The lost worker's last chunk never reached the edge; its hand-back had it in memory.
    router, client = accepted_router()
    for record in [said(0, "The bus"), reset(1), said(0, "The bus leaves", 1)]:
        router.route(record)
    router.route(said(1, " when", 1))
    assert texts(client) == "The bus leaves when"
    assert "chat.reset" not in client.kinds
    assert client.shown() == [(0, 0), (0, 1), (0, 2)]


def test_an_attempt_that_starts_over_is_shown_as_a_reset() -> None:
    router, client = accepted_router()
    for record in [*LOST_AFTER_TWO, said(0, "A different", 1), said(1, " answer", 1)]:
        router.route(record)
    assert client.kinds.count("chat.reset") == 1
    assert texts(client) == "A different answer"
    assert client.shown() == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_same_length_other_text_is_no_continuation() -> None:
    router, client = accepted_router()
    for record in [*LOST_AFTER_TWO, said(0, "The bug leaves", 1)]:
        router.route(record)
    assert client.kinds.count("chat.reset") == 1
    assert texts(client) == "The bug leaves"


def test_the_lost_workers_late_records_are_dropped_after_the_reset() -> None:
    router, client = accepted_router()
    for record in [*LOST_AFTER_TWO, said(2, " late", 0), said(0, "The bus leaves", 1)]:
        router.route(record)
    assert texts(client) == "The bus leaves"


def test_an_error_as_a_new_attempts_first_record_ends_the_stream_without_a_reset() -> None:
    router, client = accepted_router()
    for record in LOST_AFTER_TWO:
        router.route(record)
    router.route(ErrorResult.for_request(reset(1), ErrorCode.internal, "the engine failed"))
    assert client.kinds == ["chat.accepted", "chat.delta", "chat.delta", "error"]


def test_continuations_chain_over_several_lost_attempts() -> None:
    router, client = accepted_router()
    log = [
        *LOST_AFTER_TWO,
        said(0, "The bus leaves", 1),
        said(1, " when", 1),
        reset(2),
        said(0, "The bus leaves when", 2),
        said(1, " full", 2),
    ]
    for record in log:
        router.route(record)
    router.route(done(2, attempt=2))
    assert texts(client) == "The bus leaves when full"
    assert client.shown() == [(0, i) for i in range(4)]


def test_a_continued_delta_shows_no_logprobs_for_the_text_shown_before() -> None:
    router, client = accepted_router()
    mark = [TokenLogprob(token="x", logprob=-0.5)]
    first = DeltaResult(request_id=RID, seq=0, text="The", logprobs=mark)
    again = DeltaResult(request_id=RID, attempt=1, seq=0, text="The bus")
    for record in [first, reset(1), again]:
        router.route(record)
    shown = [f for f in client.frames if f.type == "chat.delta"]
    assert [(f.text, f.logprobs) for f in shown] == [("The", mark), (" bus", None)]  # type: ignore[union-attr]


def test_a_resume_across_a_continuation_gets_only_what_follows_its_point() -> None:
    log = [*LOST_AFTER_TWO, said(0, "The bus leaves", 1), said(1, " when", 1), said(2, " full", 1)]
    router = StreamRouter()
    client = Client()
    # The client saw "The bus leaves when" (shown seqs 0, 1, 2 of shown attempt 0).
    router.resume(RID, client, ResumePoint(attempt=0, after_seq=2))
    for record in log:
        router.route(record)
    assert router.caught_up(RID)
    assert client.kinds == ["stream.resumed", "chat.delta"]
    assert [(f.seq, f.text) for f in client.frames[1:]] == [(3, " full")]  # type: ignore[union-attr]


def test_a_resume_claiming_a_continued_delta_not_in_the_log_is_refused() -> None:
    router = StreamRouter()
    client = Client()
    router.resume(RID, client, ResumePoint(attempt=0, after_seq=3))
    for record in [*LOST_AFTER_TWO, said(0, "The bus leaves", 1), said(1, " when", 1)]:
        router.route(record)
    assert not router.caught_up(RID)
    assert client.kinds == ["error"]


@st.composite
def lost_answers(draw: st.DrawFn) -> tuple[list[DeltaResult | ResetResult], str]:
    """An answer cut into chunks, its attempts lost after any of them, each next attempt
    continuing what the last one wrote (its first delta: all of it), records read twice."""
    chunks = draw(st.lists(st.text("ab ", min_size=1, max_size=3), min_size=1, max_size=8))
    log: list[DeltaResult | ResetResult] = []
    attempt, at, seq = 0, 0, 0
    while at < len(chunks):
        step = draw(st.integers(1, len(chunks) - at))
        for chunk in chunks[at : at + step]:
            record = said(seq, chunk, attempt)
            log.append(record)
            if draw(st.booleans()):
                log.append(record)  # a duplicate
            seq += 1
        at += step
        if at < len(chunks):
            attempt += 1
            log += [reset(attempt), said(0, "".join(chunks[:at]), attempt)]
            seq = 1
    return log, "".join(chunks)


@given(lost_answers(), st.integers(0, 40))
def test_any_chain_of_continuations_shows_the_answer_once_and_a_resume_agrees(
    case: tuple[list[DeltaResult | ResetResult], str], cut: int
) -> None:
    log, answer = case
    router, client = accepted_router()
    for record in log:
        router.route(record)
    assert "chat.reset" not in client.kinds
    assert texts(client) == answer
    seqs = [f.seq for f in client.frames if f.type == "chat.delta"]  # type: ignore[union-attr]
    assert seqs == list(range(len(seqs)))
    # A client that saw the first `cut` frames resumes: it gets the rest, once.
    cut = min(cut, len(seqs))
    resumed = StreamRouter()
    other = Client()
    resumed.resume(RID, other, ResumePoint(attempt=0, after_seq=cut - 1))
    for record in log:
        resumed.route(record)
    assert resumed.caught_up(RID)
    seen = [f for f in client.frames if f.type == "chat.delta"][:cut]
    rest = [f for f in other.frames if f.type == "chat.delta"]
    assert "".join(f.text for f in [*seen, *rest]) == answer  # type: ignore[union-attr]


def frames_of(log: list[DeltaResult | ResetResult]) -> list[ServerFrame]:
    router, client = accepted_router()
    for record in log:
        router.route(record)
    router.route(done(2, attempt=1))
    return client.frames[1:]


def test_the_openai_stream_goes_on_through_a_continuation_without_an_error_event() -> None:
    sse = SseStream(CHAT, include_usage=False)
    events = [
        e
        for f in frames_of([*LOST_AFTER_TWO, said(0, "The bus leaves", 1), said(1, " when", 1)])
        for e in sse.take(f)
    ]
    bodies = [json.loads(e.split(b"data: ", 1)[1]) for e in events if b"[DONE]" not in e]
    assert not sse.cancel
    assert all("error" not in b for b in bodies)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in bodies)
    assert text == "The bus leaves when"


def test_a_non_streaming_answer_through_a_continuation_is_whole() -> None:
    answer = Answer(CHAT)
    for frame in frames_of([*LOST_AFTER_TWO, said(0, "The bus leaves", 1), said(1, " when", 1)]):
        answer.take(frame)
    assert answer.result is not None
    assert answer.result.choices[0].message.content == "The bus leaves when"  # type: ignore[union-attr]


def test_result_stream_keeps_a_digest_not_the_text() -> None:
    router, _ = accepted_router()
    router.route(said(0, "x" * 10_000))
    [stream] = list(router)
    assert isinstance(stream, ResultStream)
    assert stream.shown.chars == 10_000
    assert not hasattr(stream.shown, "__dict__")
