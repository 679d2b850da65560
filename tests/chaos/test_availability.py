"""The availability figures on hand-written samples: ratios, TTFT by window, recovery, check."""

from __future__ import annotations

import pytest

from tests.chaos.availability import (
    STEADY,
    FaultWindow,
    Figures,
    Row,
    Sample,
    Scope,
    check,
    figures,
    markdown,
    recovery_s,
    ttft_quantiles,
)
from tests.chaos.checker import Channel

FAULT = FaultWindow("kill -9 broker node 2", 40.0, 60.0)


def ok(at_s: float, ttft_s: float = 0.2, channel: Channel = "websocket") -> Sample:
    return Sample(channel, at_s, ttft_s, accepted=True, answered=True, final_code="done")


def steady_load(channel: Channel = "websocket", ttft_s: float = 0.2) -> list[Sample]:
    """One request every 0.5 s over 0-100 s, all answered at `ttft_s`."""
    return [ok(i * 0.5, ttft_s, channel) for i in range(200)]


def during(samples: list[Sample], window: FaultWindow, tail_s: float = 0.0) -> list[Sample]:
    return [s for s in samples if window.holds(s.sent_at_s, tail_s)]


def slowed(samples: list[Sample], window: FaultWindow, ttft_s: float) -> list[Sample]:
    """`samples` with every request sent in `window` answered at `ttft_s`."""
    return [ok(s.sent_at_s, ttft_s, s.channel) if window.holds(s.sent_at_s) else s for s in samples]


def healthy() -> list[Sample]:
    return steady_load("websocket") + steady_load("kafka", ttft_s=0.3)


def row(result: Figures, label: str, scope: Scope = "all") -> Row:
    return next(r for r in result.rows if r.label == label and r.scope == scope)


# -- inputs ---------------------------------------------------------------------------------


def test_bad_inputs_are_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"ends at 1\.0 before 2\.0"):
        FaultWindow("x", 2.0, 1.0)
    with pytest.raises(ValueError, match="answered but never accepted"):
        Sample("kafka", 1.0, 0.1, accepted=False, answered=True)
    with pytest.raises(ValueError, match="negative TTFT"):
        Sample("kafka", 1.0, -0.1, accepted=True, answered=True)
    with pytest.raises(ValueError, match="unknown channel 'grpc'"):
        Sample("grpc", 1.0, 0.1, accepted=True, answered=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not be negative"):
        figures([], [], settle_s=-1)


def test_percentiles_interpolate_linearly_and_skip_requests_without_a_first_token() -> None:
    samples = [ok(i, ttft) for i, ttft in enumerate((0.5, 0.1, 0.4, 0.2, 0.3))]
    samples.append(Sample("websocket", 9, None, accepted=True, answered=False))
    p50, p99 = ttft_quantiles(samples)
    assert p50 == pytest.approx(0.3)
    assert p99 == pytest.approx(0.4 + 0.1 * 0.96)  # rank 0.99 * 4 = 3.96
    assert ttft_quantiles([Sample("kafka", 1, None, accepted=False, answered=False)]) == (
        None,
        None,
    )


# -- ratios ---------------------------------------------------------------------------------


def test_totals_count_offered_accepted_and_answered_per_channel_and_together() -> None:
    samples = [
        ok(1.0),
        Sample("websocket", 2.0, None, accepted=False, answered=False, final_code="overloaded"),
        Sample("websocket", 3.0, 0.2, accepted=True, answered=False, final_code="internal"),
        ok(4.0, channel="kafka"),
        Sample("kafka", 5.0, None, accepted=True, answered=False),  # no final: lost
    ]
    result = figures(samples, [])
    ws, kafka, both = (result.total(s) for s in ("websocket", "kafka", "all"))
    assert (ws.offered, ws.accepted, ws.answered) == (3, 2, 1)
    assert (kafka.offered, kafka.accepted, kafka.answered) == (2, 2, 1)
    assert (both.offered, both.accepted, both.answered) == (5, 4, 2)
    assert both.accepted_ratio == pytest.approx(0.8)
    assert both.answered_ratio == pytest.approx(0.5)  # of the accepted


# -- windows --------------------------------------------------------------------------------


def test_steady_state_leaves_out_each_fault_window_and_its_tail() -> None:
    samples = healthy()
    result = figures(samples, [FAULT], tail_s=5.0)
    steady = result.steady("websocket")
    assert steady.label == STEADY
    assert steady.window is None
    # 0-100 s at 2/s, less the 45.5 s of [40, 65]: 40-65 holds 51 sends.
    assert steady.sent == 200 - len(during(steady_load(), FAULT, 5.0)) == 149
    assert row(result, FAULT.label, "websocket").sent == len(during(steady_load(), FAULT)) == 41
    assert row(result, FAULT.label).sent == 82


def test_a_slow_fault_window_shows_in_its_row_against_steady() -> None:
    samples = slowed(healthy(), FAULT, 1.0)
    result = figures(samples, [FAULT], settle_s=10.0)
    steady, fault = result.steady("websocket"), row(result, FAULT.label, "websocket")
    assert steady.ttft_p99_s == pytest.approx(0.2)
    assert fault.ttft_p50_s == pytest.approx(1.0)
    assert fault.p99_ratio == pytest.approx(5.0)
    assert fault.p99_after_settle_s == pytest.approx(1.0)
    assert fault.after_settle_ratio == pytest.approx(5.0)
    # The last slow request was sent at 60 s, its first token at 61 s.
    assert fault.recovery_s == pytest.approx(1.0)


def test_after_settle_leaves_out_the_election_at_the_fault_start() -> None:
    # Slow for the first 10 s of the fault (leader election), normal after.
    samples = [
        ok(s.sent_at_s, 3.0) if 40.0 <= s.sent_at_s < 50.0 else s for s in steady_load("websocket")
    ]
    result = figures(samples, [FAULT], settle_s=10.0)
    fault = row(result, FAULT.label)
    assert fault.ttft_p99_s == pytest.approx(3.0)
    assert fault.p99_after_settle_s == pytest.approx(0.2)
    assert fault.after_settle_ratio == pytest.approx(1.0)
    assert fault.recovery_s == 0.0  # the last slow first token (sent 49.5 s) came at 52.5 s
    assert check(result) == []


def test_a_fault_shorter_than_settle_has_nothing_after_settle() -> None:
    short = FaultWindow("kill -9 edge-a", 10.0, 11.5)
    result = figures(steady_load(), [short], settle_s=10.0)
    fault = row(result, short.label)
    assert fault.sent == 4
    assert fault.p99_after_settle_s is None
    assert fault.after_settle_ratio is None


# -- recovery -------------------------------------------------------------------------------


def test_recovery_runs_to_the_latest_slow_first_token_near_the_fault() -> None:
    window = FaultWindow("f", 10.0, 12.0)
    samples = [
        ok(1.0, 30.0),  # slow, but sent long before the fault (beyond the tail): not this one
        ok(9.0, 6.0),  # in flight when it struck: first token at 15 s
        ok(11.0, 1.5),  # slow, first token at 12.5 s
        ok(13.0, 0.1),  # fast
        ok(16.5, 4.0),  # after the tail: another story
    ]
    assert recovery_s(samples, window, slow_above_s=1.0, tail_s=2.0) == pytest.approx(3.0)
    assert recovery_s(samples, window, slow_above_s=10.0, tail_s=2.0) == 0.0
    # A slow request whose first token came before the fault ended: recovered at the end.
    assert recovery_s([ok(10.0, 1.5)], window, slow_above_s=1.0, tail_s=2.0) == 0.0


def test_recovery_is_unknown_without_a_steady_state() -> None:
    everything = FaultWindow("all along", 0.0, 100.0)
    result = figures(steady_load(), [everything])
    assert result.steady("all").sent == 0
    assert row(result, everything.label).recovery_s is None
    assert row(result, everything.label).p99_ratio is None


# -- check ----------------------------------------------------------------------------------


def test_a_healthy_run_passes_the_check() -> None:
    result = figures(healthy(), [FAULT, FaultWindow("kill -9 ingest", 70.0, 72.0)])
    assert check(result) == []
    assert check(result, max_recovery_s=0.0) == []


def test_refusals_fail_availability_for_their_channel_and_the_whole() -> None:
    samples = [
        Sample("kafka", s.sent_at_s, None, accepted=False, answered=False)
        if s.channel == "kafka" and FAULT.holds(s.sent_at_s)
        else s
        for s in healthy()
    ]
    failed = check(figures(samples, [FAULT]))
    assert any(f.startswith("kafka: accepted/offered 79.5 % (159/200) < 99.0 %") for f in failed)
    assert any(f.startswith("all: accepted/offered") for f in failed)
    assert not any(f.startswith("websocket") for f in failed)


def test_accepted_but_unanswered_requests_fail_answered() -> None:
    samples = healthy()
    samples[10] = Sample("websocket", samples[10].sent_at_s, 0.2, True, False, "internal")
    samples[11] = Sample("websocket", samples[11].sent_at_s, None, True, False, None)
    # 198/200 is 99.0 % exactly: it passes; a third unanswered fails it.
    assert check(figures(samples, [FAULT])) == []
    samples[12] = Sample("websocket", samples[12].sent_at_s, None, True, False, None)
    failed = check(figures(samples, [FAULT]))
    assert failed == ["websocket: answered/accepted 98.5 % (197/200) < 99.0 %"]
    assert row(figures(samples, [FAULT]), STEADY, "websocket").no_first_token == 2


def test_a_request_in_flight_when_a_fault_struck_is_not_steady_state() -> None:
    # Sent 1 s before the fault, its first token 15 s later: the fault's, not the baseline's.
    samples = [*steady_load(), ok(39.0, 15.0)]
    steady = row(figures(samples, [FAULT]), STEADY, "websocket")
    assert steady.ttft_p99_s == pytest.approx(0.2)
    assert steady.sent == len([s for s in steady_load() if not FAULT.holds(s.sent_at_s, 5.0)])


def test_a_slow_fault_after_settle_fails_the_p99_ratio() -> None:
    samples = slowed(steady_load(), FAULT, 0.7)
    failed = check(figures(samples, [FAULT]))
    assert failed == [
        "all kill -9 broker node 2: p99 TTFT after settle 0.70 s is 3.50x steady, over 2x",
        "websocket kill -9 broker node 2: p99 TTFT after settle 0.70 s is 3.50x steady, over 2x",
    ]
    assert check(figures(samples, [FAULT]), max_p99_ratio=4.0) == []
    # Judged only for the scopes named.
    assert check(figures(samples, [FAULT]), ttft_scopes=("websocket",)) == failed[1:]


def test_a_slow_recovery_fails_when_bounded() -> None:
    # Sent before the election settled, its first token 10 s after the fault's end.
    samples = [*steady_load(), ok(45.0, 25.0)]
    result = figures(samples, [FAULT])
    assert row(result, FAULT.label).recovery_s == pytest.approx(10.0)
    assert check(result) == []
    assert check(result, max_recovery_s=5.0) == [
        "all kill -9 broker node 2: recovered after 10.0 s, over 5 s",
        "websocket kill -9 broker node 2: recovered after 10.0 s, over 5 s",
    ]


def test_nothing_to_judge_fails() -> None:
    assert check(figures([], [FAULT])) == ["nothing was offered: no availability to judge"]
    everything = FaultWindow("all along", 0.0, 100.0)
    assert check(figures(steady_load(), [everything])) == [
        "all: no steady-state TTFT to compare the fault windows with",
        "websocket: no steady-state TTFT to compare the fault windows with",
    ]


# -- markdown -------------------------------------------------------------------------------


def test_markdown_has_the_summary_and_one_row_per_window_and_scope() -> None:
    samples = slowed(healthy(), FAULT, 1.0)
    text = markdown(figures(samples, [FAULT], settle_s=10.0))
    lines = text.splitlines()
    assert lines[0].startswith("all: offered 400, accepted 400 (100.0 %), answered 400")
    assert "kafka: offered 200" in lines[0]
    assert "p99 after settle (10 s)" in lines[2]
    rows = [line for line in lines[4:] if line.startswith("|")]
    assert len(rows) == 6  # steady and one fault, for all, websocket and kafka
    assert rows[0] == (
        "| steady | all | - | 298 | 100.0 % | 100.0 % | 0 | 0.25 | 0.30 | - | - | - |"
    )
    assert rows[3] == (
        "| kill -9 broker node 2 | websocket | 40.0-60.0 | 41 | 100.0 % | 100.0 % | 0"
        " | 1.00 | 1.00 | 5.00x | 1.00 (5.00x) | 1.0 |"
    )
    only = markdown(figures(samples, [FAULT]), scopes=("all",))
    assert "websocket" not in only
