"""Reading a service's log lines back (bench/service_logs.py), and the sample summary the
bench and the tests print beside them (bench/stats.py `percentiles`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.service_logs import events, parse_line
from bench.stats import percentiles

LINES = [
    "2026-12-02T03:00:00Z level='info' event='request.finished' request_id='r-1' gap_ms=4.5",
    "2026-12-02T03:00:01Z level='info' event='cancel.applied' request_id='r-2'",
    "2026-12-02T03:00:02Z level='info' event='request.finished' request_id='r-3' note=\"it's\"",
    "2026-12-02T03:00:03Z level='info' event='request.finished.late' request_id='r-4'",
]


def test_a_line_reads_as_its_typed_pairs_and_unreadable_values_stay_text() -> None:
    fields = parse_line("event='x' size=3 ratio=0.5 ok=True raw=a-b note='a \\'q\\''")
    assert fields == {
        "event": "x",
        "size": 3,
        "ratio": 0.5,
        "ok": True,
        "raw": "a-b",
        "note": "a 'q'",
    }


def test_events_are_the_lines_of_that_event_only(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    assert events(log, "request.finished") == []  # no log yet: nothing happened
    log.write_text("\n".join(LINES) + "\n")
    finished = events(log, "request.finished")
    assert [e["request_id"] for e in finished] == ["r-1", "r-3"]
    assert (finished[0]["gap_ms"], finished[1]["note"]) == (4.5, "it's")


def test_percentiles_of_a_sample_and_of_none() -> None:
    assert percentiles([4.0, 1.0, 3.0, 2.0, 5.0]) == {
        "n": 5,
        "min": 1.0,
        "p50": 3.0,
        "p90": 4.6,
        "p99": pytest.approx(4.96),
        "max": 5.0,
    }
    with pytest.raises(ValueError, match="no values"):
        percentiles([])
