"""The chaos checker on hand-made histories: clean ones pass, and each kind of fault fails."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chaos.checker import Channel, History, Verdict, failures, judge, summarize, table

TEXT = "The bus leaves."


def ws(*frames: dict[str, Any], expected: str = TEXT, rid: str = "r1") -> Verdict:
    return judge(History(rid, "websocket", expected, (accepted(rid), *frames)))


def kafka(*records: dict[str, Any], expected: str = TEXT, rid: str = "k1") -> Verdict:
    return judge(History(rid, "kafka", expected, records))


def accepted(rid: str = "r1") -> dict[str, Any]:
    return {"type": "chat.accepted", "request_id": rid, "resume_token": "t", "tier": "interactive"}


def delta(seq: int, text: str) -> dict[str, Any]:
    return {"type": "chat.delta", "request_id": "r1", "seq": seq, "text": text}


def done() -> dict[str, Any]:
    return {"type": "chat.done", "request_id": "r1", "finish_reason": "stop"}


def error(code: str = "overloaded") -> dict[str, Any]:
    return {"type": "error", "request_id": "r1", "code": code, "message": "m"}


def reset(attempt: int) -> dict[str, Any]:
    return {"type": "chat.reset", "request_id": "r1", "attempt": attempt}


def resumed(attempt: int, after_seq: int) -> dict[str, Any]:
    return {
        "type": "stream.resumed",
        "request_id": "r1",
        "attempt": attempt,
        "after_seq": after_seq,
    }


def rec(kind: str, attempt: int, seq: int, body: str = "") -> dict[str, Any]:
    record: dict[str, Any] = {"request_id": "k1", "attempt": attempt, "seq": seq, "kind": kind}
    if kind == "delta":
        record["text"] = body
    elif kind == "error":
        record.update(code=body, message="m")
    return record


# -- websocket: what passes ----------------------------------------------------------------


def test_a_whole_stream_passes() -> None:
    v = ws(delta(0, "The bus"), delta(1, " leaves."), done())
    assert v.ok
    assert v.outcome == "done"
    assert v.problems == ()


def test_a_new_attempt_after_reset_is_judged_on_its_own_text() -> None:
    v = ws(delta(0, "The"), delta(1, " bus"), reset(1), delta(0, "The bus"), delta(1, " leaves."))
    assert v.lost
    v = ws(delta(0, "The"), reset(1), delta(0, "The bus"), delta(1, " leaves."), done())
    assert v.ok, v.problems


def test_a_resumed_stream_continues_where_the_client_was() -> None:
    v = ws(delta(0, "The bus"), resumed(0, 0), delta(1, " leaves."), done())
    assert v.ok, v.problems


def test_an_error_with_a_stable_code_is_a_final_outcome() -> None:
    v = ws(delta(0, "The"), error("not_found"))
    assert v.ok
    assert v.outcome == "not_found"


# -- websocket: what must fail -------------------------------------------------------------


def test_no_final_is_lost() -> None:
    v = ws(delta(0, "The bus"), delta(1, " leaves."))
    assert v.lost
    assert not v.ok
    assert v.problems == ("no final outcome",)
    assert ws().lost  # accepted, then nothing


def test_a_repeated_delta_is_a_duplicate() -> None:
    v = ws(delta(0, "The bus"), delta(0, "The bus"), delta(1, " leaves."), done())
    assert v.duplicated
    assert not v.ok
    assert "shown again" in v.problems[0]


def test_a_gap_is_corrupt() -> None:
    v = ws(delta(0, "The bus"), delta(2, " leaves."), done())
    assert v.corrupt
    assert not v.ok
    assert any("gap" in p for p in v.problems)


def test_out_of_order_deltas_fail() -> None:
    v = ws(delta(1, " leaves."), delta(0, "The bus"), done())
    assert not v.ok


def test_two_finals_are_a_duplicate() -> None:
    assert ws(delta(0, TEXT), done(), done()).duplicated
    assert ws(delta(0, TEXT), done(), error("cancelled")).duplicated
    assert ws(error("overloaded"), error("overloaded")).duplicated


def test_anything_after_the_final_is_a_duplicate() -> None:
    v = ws(delta(0, TEXT), done(), reset(1))
    assert v.duplicated
    assert v.outcome == "done"


def test_wrong_text_is_corrupt() -> None:
    v = ws(delta(0, "The bus"), delta(1, " stays."), done())
    assert v.corrupt
    assert "character 8" in v.problems[0]
    assert ws(delta(0, "The bus"), done()).corrupt  # a prefix is not the text


def test_a_reset_must_name_a_newer_attempt() -> None:
    assert ws(reset(1), delta(0, TEXT), reset(1), delta(0, TEXT), done()).corrupt
    assert ws(reset(0), delta(0, TEXT), done()).corrupt


def test_an_unknown_error_code_is_corrupt() -> None:
    v = ws(error("boom"))
    assert v.corrupt
    assert v.outcome == "boom"


def test_a_resume_elsewhere_than_the_client_was_is_corrupt() -> None:
    assert ws(delta(0, "The bus"), resumed(0, 3), delta(1, " leaves."), done()).corrupt


# -- kafka ---------------------------------------------------------------------------------


def test_kafka_whole_stream_passes() -> None:
    v = kafka(rec("delta", 0, 0, "The bus"), rec("delta", 0, 1, " leaves."), rec("done", 0, 2))
    assert v.ok
    assert v.outcome == "done"


def test_kafka_consumer_rules_drop_stale_and_identical_records() -> None:
    v = kafka(
        rec("delta", 0, 0, "The"),
        rec("delta", 1, 0, "The bus"),
        rec("delta", 0, 1, " zombie"),  # the old attempt, still writing
        rec("delta", 1, 0, "The bus"),  # the same record again
        rec("delta", 1, 1, " leaves."),
        rec("done", 1, 2),
        rec("done", 1, 2),
        rec("done", 0, 2),
    )
    assert v.ok, v.problems
    assert (v.redelivered, v.stale) == (2, 2)


def test_kafka_reset_records_start_the_attempt_they_name() -> None:
    v = kafka(
        rec("delta", 0, 0, "The"),
        rec("reset", 1, 0),
        rec("delta", 0, 1, " zombie"),
        rec("delta", 1, 0, TEXT),
        rec("reset", 1, 0),
        rec("done", 1, 1),
    )
    assert v.ok, v.problems
    assert v.stale == 2
    # The first final ends the request (ADR 0054): a re-run announced after it is dropped,
    # and counted as work done twice.
    after = kafka(rec("delta", 0, 0, TEXT), rec("done", 0, 1), rec("reset", 1, 0))
    assert after.ok, after.problems
    assert after.rerun_after_final
    settled = kafka(rec("delta", 0, 0, TEXT), rec("done", 0, 1), rec("reset", 0, 0))
    assert settled.ok
    assert not settled.rerun_after_final
    assert settled.stale == 1


def test_kafka_lost_duplicated_gap_conflict() -> None:
    assert kafka(rec("delta", 0, 0, TEXT)).lost
    assert kafka().lost
    rerun = kafka(
        rec("delta", 0, 0, TEXT), rec("done", 0, 1), rec("delta", 1, 0, TEXT), rec("done", 1, 1)
    )
    assert rerun.ok
    assert rerun.outcome == "done"
    assert rerun.rerun_after_final
    two = kafka(rec("delta", 0, 0, TEXT), rec("done", 0, 1), rec("error", 0, 2, "internal"))
    assert two.corrupt
    assert not two.duplicated
    assert two.problems == ("error of attempt 0 seq 2 after its final",)
    gap = kafka(rec("delta", 0, 0, "The bus"), rec("delta", 0, 2, " leaves."), rec("done", 0, 3))
    assert gap.corrupt
    assert gap.lost
    conflict = kafka(rec("delta", 0, 0, "The bus"), rec("delta", 0, 0, "A car"), rec("done", 0, 1))
    assert conflict.corrupt
    assert kafka(rec("delta", 0, 0, "The bus"), rec("done", 0, 1)).corrupt  # wrong text


# -- summary and table ---------------------------------------------------------------------


def _verdicts() -> list[Verdict]:
    good = ws(delta(0, TEXT), done(), rid="a")
    errored = ws(error("deadline_exceeded"), rid="b")
    lost = ws(delta(0, TEXT), rid="c")
    rerun = kafka(rec("delta", 0, 0, TEXT), rec("done", 0, 1), rec("done", 1, 0), rid="d")
    dup = ws(delta(0, TEXT), done(), done(), rid="e")
    return [good, errored, lost, rerun, dup]


def test_summary_counts_each_outcome() -> None:
    s = summarize(_verdicts())
    assert (s.acknowledged, s.done, s.lost, s.duplicated, s.corrupt) == (5, 3, 1, 1, 0)
    assert s.rerun_after_final == 1
    assert s.errors == {"deadline_exceeded": 1}
    assert not s.passed


def test_an_empty_run_does_not_pass() -> None:
    assert not summarize([]).passed


@pytest.mark.parametrize("channel", ["websocket", "kafka"])
def test_a_clean_run_passes(channel: Channel) -> None:
    v = ws(delta(0, TEXT), done()) if channel == "websocket" else kafka(rec("delta", 0, 0, TEXT))
    assert summarize([v]).passed == (channel == "websocket")


def test_table_and_failures_name_the_counts() -> None:
    text = table(_verdicts())
    assert "| websocket | 4 | 2 | deadline_exceeded: 1 | 1 | 1 | 0 | 0 | 0 | 0 |" in text
    assert "| kafka | 1 | 1 | 0 | 0 | 0 | 0 | 0 | 0 | 1 |" in text
    assert "| all | 5 | 3 | deadline_exceeded: 1 | 1 | 1 | 0 | 0 | 0 | 1 |" in text
    listed = failures(_verdicts())
    assert "websocket c: no final outcome" in listed
    assert "websocket e: chat.done after the final (done)" in listed
    assert "kafka d" not in listed


# -- openai: the SDK's streams and whole answers ----------------------------------------------


def sse(event_id: str | None, data: object) -> dict[str, Any]:
    return {"id": event_id, "data": data}


def chunk(event_id: str, text: str | None, finish: str | None = None) -> dict[str, Any]:
    delta = {"content": text} if text is not None else {}
    return sse(event_id, {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def streamed(*events: dict[str, Any], expected: str = TEXT) -> Verdict:
    return judge(History("o1", "openai-stream", expected, events))


def answered(*events: dict[str, Any], expected: str = TEXT) -> Verdict:
    return judge(History("o2", "openai", expected, events))


ROLE = sse("0:-1", {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
USAGE = sse("0:1", {"choices": [], "usage": {"completion_tokens": 3}})


def test_an_sse_stream_with_its_finish_and_done_is_one_whole_answer() -> None:
    v = streamed(
        ROLE,
        chunk("0:0", "The bus "),
        chunk("0:1", "leaves."),
        chunk("0:1", None, "stop"),
        USAGE,
        sse(None, "[DONE]"),
    )
    assert v.ok, v.problems
    assert v.outcome == "done"


def test_an_sse_stream_resumed_on_the_other_edge_goes_on_after_its_last_event() -> None:
    v = streamed(
        ROLE,
        chunk("0:0", "The bus "),
        {"dropped": "RemoteProtocolError", "edge": 0},
        {"resumed": "0:0", "edge": 1},
        chunk("0:1", "leaves."),
        chunk("0:1", None, "stop"),
        sse(None, "[DONE]"),
    )
    assert v.ok, v.problems


def test_text_first_shown_under_a_later_attempt_passes() -> None:
    # An attempt reset before it showed text: the stream's text comes under the next one.
    v = streamed(
        ROLE,
        chunk("1:0", "The bus "),
        chunk("1:1", "leaves."),
        chunk("1:1", None, "stop"),
        sse(None, "[DONE]"),
    )
    assert v.ok, v.problems
    assert streamed(ROLE, chunk("1:0", "The bus ")).lost  # no [DONE]: no outcome yet


@pytest.mark.parametrize(
    ("events", "what"),
    [
        ((chunk("0:0", "The bus "), chunk("0:0", "The bus ")), "duplicated"),
        ((chunk("0:0", "The bus "), chunk("0:2", "leaves.")), "corrupt"),
        ((chunk("0:0", "The bus "), chunk("1:1", "leaves.")), "corrupt"),
        ((chunk("0:0", "The bus "), chunk("0:1", "leaves!")), "corrupt"),
        ((chunk("0:0", "The bus leaves."),), "corrupt"),  # [DONE] without a finish
    ],
)
def test_an_sse_stream_that_repeats_skips_or_changes_text_fails(
    events: tuple[dict[str, Any], ...], what: str
) -> None:
    finish = () if what == "corrupt" and len(events) == 1 else (chunk("0:1", None, "stop"),)
    v = streamed(ROLE, *events, *finish, sse(None, "[DONE]"))
    assert getattr(v, what), v.problems


def test_an_sse_error_event_is_the_outcome_and_its_done_belongs_to_it() -> None:
    error_event = sse("0:0", {"error": {"code": "internal", "message": "m"}})
    v = streamed(ROLE, chunk("0:0", "The bus "), error_event, sse(None, "[DONE]"))
    assert v.outcome == "sse error internal"
    assert v.ok, v.problems


def test_an_event_after_done_is_a_duplicate() -> None:
    v = streamed(
        chunk("0:0", TEXT), chunk("0:0", None, "stop"), sse(None, "[DONE]"), chunk("0:1", "x")
    )
    assert v.duplicated


def test_a_whole_answer_is_judged_by_its_text_and_a_status_is_its_outcome() -> None:
    assert answered({"dropped": "APIConnectionError", "edge": 0}, {"answer": TEXT}).ok
    assert answered({"answer": "The bus left."}).corrupt
    status = answered({"status": 504, "code": "deadline_exceeded"})
    assert status.outcome == "http 504 deadline_exceeded"
    assert status.ok
    assert answered({"dropped": "APIConnectionError", "edge": 0}).lost


def test_a_draining_edges_error_event_is_no_outcome_the_stream_goes_on_elsewhere() -> None:
    # ADR 0073: at its drain bound an edge ends the stream with `edge_restarting`, naming
    # the last event it sent; the client resumes at another edge from that event.
    restarting = sse("0:0", {"error": {"code": "edge_restarting", "message": "m"}})
    v = streamed(
        ROLE,
        chunk("0:0", "The bus "),
        restarting,
        {"dropped": "the stream ended without [DONE]", "edge": 0},
        {"resumed": "0:0", "edge": 1},
        chunk("0:1", "leaves."),
        chunk("0:1", None, "stop"),
        sse(None, "[DONE]"),
    )
    assert v.ok, v.problems
    assert v.outcome == "done"
    assert streamed(ROLE, chunk("0:0", "The bus "), restarting).lost  # not resumed: no end
