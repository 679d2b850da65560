"""Cold models on plain values: hold or refuse a request for a model with no live worker,
each model's load time from its workers' heartbeats, the worker's own measurement, and the
models a deployment names (`served_models`) known while none of their workers is live."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.edge.models import ModelDirectory
from services.scheduler.cold_start import LoadTimes, Refusal, cold_refusal, refusals
from services.scheduler.limits import PolicyConfig, TierLimits
from services.scheduler.models import ModelCheck
from services.scheduler.policy import Policy, WorkerSlots
from services.worker.load_time import load_seconds, process_started_at
from shared.messages import ChatRequest, Heartbeat, Tier
from shared.settings import TokenbusSettings

NOW = 1000.0
INT = Tier.interactive


# -- the pure decision --------------------------------------------------------------------------


def test_a_request_without_a_deadline_is_held() -> None:
    assert cold_refusal("big", NOW, None, load_s=600.0) is None


def test_a_deadline_that_can_wait_a_whole_load_is_held() -> None:
    assert cold_refusal("big", NOW, NOW + 30.0, load_s=30.0) is None
    assert cold_refusal("big", NOW, NOW + 31.0, load_s=30.0) is None


def test_a_deadline_shorter_than_the_load_is_refused_with_the_load_time() -> None:
    refusal = cold_refusal("big", NOW, NOW + 5.0, load_s=12.3456)
    assert refusal == Refusal(
        12346,
        "model big has no live worker: one takes about 12.3 s to start, more than this"
        " request's deadline allows; retry after 12346 ms",
    )


@given(
    allowed=st.floats(min_value=0.0, max_value=1e4),
    load_s=st.floats(min_value=0.001, max_value=1e4),
)
def test_refused_exactly_when_the_deadline_is_shorter_than_the_load(
    allowed: float, load_s: float
) -> None:
    refusal = cold_refusal("m", NOW, NOW + allowed, load_s)
    assert (refusal is not None) == (NOW + allowed - NOW < load_s)
    if refusal is not None:
        assert refusal.retry_after_ms >= load_s * 1000.0
        assert refusal.retry_after_ms - 1 < load_s * 1000.0


# -- load times ---------------------------------------------------------------------------------


def test_the_default_until_a_worker_measured_then_the_newest_workers() -> None:
    times = LoadTimes(default_s=60.0)
    assert times.of("big") == 60.0
    times.observe("big", started_at=10.0, load_s=None)  # a worker that does not say
    assert times.of("big") == 60.0
    times.observe("big", started_at=10.0, load_s=8.0)
    assert times.of("big") == 8.0
    times.observe("big", started_at=20.0, load_s=5.0)  # a newer worker
    times.observe("big", started_at=15.0, load_s=9.0)  # an older one, heard later
    assert times.of("big") == 5.0
    assert times.of("small") == 60.0  # per model


# -- which waiting requests are refused ---------------------------------------------------------


def policy() -> Policy[str]:
    limits = TierLimits(max_batch_size=4, max_batch_tokens=1000, max_wait_ms=0)
    return Policy(
        PolicyConfig(
            tiers={INT: limits, Tier.background: limits},
            background_aging_ms=1000.0,
            fill_from_other_tier=False,
        )
    )


def add(
    p: Policy[str],
    name: str,
    model: str | None,
    deadline_in_s: float | None,
    fallback: str | None = None,
) -> None:
    deadline = None if deadline_in_s is None else NOW + deadline_in_s
    added = p.add(
        name,
        tier=INT,
        cost=100,
        prompt_tokens=10,
        now=NOW,
        deadline_at=deadline,
        model=model,
        fallback=fallback,
    )
    assert added is not None


def refused(p: Policy[str], workers: list[WorkerSlots], times: LoadTimes) -> dict[str, int]:
    return {
        passenger.item: r.retry_after_ms for passenger, r in refusals(p.backlog, workers, times)
    }


def test_only_requests_of_a_cold_model_that_cannot_wait_are_refused() -> None:
    p = policy()
    add(p, "short", "big", deadline_in_s=5.0)
    add(p, "long", "big", deadline_in_s=60.0)
    add(p, "forever", "big", deadline_in_s=None)
    add(p, "warm", "small", deadline_in_s=1.0)
    add(p, "any", None, deadline_in_s=1.0)  # runs on any worker: not a model's to wait for
    workers = [WorkerSlots("w1", free=0, total=4, model="small")]
    times = LoadTimes(default_s=30.0)
    assert refused(p, workers, times) == {"short": 30000}
    times.observe("big", started_at=1.0, load_s=4.0)  # a worker of it measured 4 s
    assert refused(p, workers, times) == {}
    assert p.waiting() == 5  # deciding takes nothing out


def test_a_live_worker_of_the_model_or_its_fallback_leaves_the_request_to_the_plan() -> None:
    p = policy()
    add(p, "live", "big", deadline_in_s=1.0)
    add(p, "falls-back", "cold", deadline_in_s=1.0, fallback="big")
    add(p, "both-cold", "cold", deadline_in_s=1.0, fallback="colder")
    workers = [WorkerSlots("w1", free=4, total=4, model="big")]
    assert refused(p, workers, LoadTimes(default_s=10.0)) == {"both-cold": 10000}


def test_a_worker_without_slots_is_no_live_worker() -> None:
    p = policy()
    add(p, "r", "big", deadline_in_s=1.0)
    workers = [WorkerSlots("w1", free=0, total=0, model="big")]
    assert refused(p, workers, LoadTimes(default_s=10.0)) == {"r": 10000}


def test_nothing_is_taken_for_cold_before_every_live_worker_could_be_heard() -> None:
    check = ModelCheck(listening_since=NOW, grace_s=3.0)
    assert not check.settled(NOW + 2.9)
    assert check.settled(NOW + 3.0)


# -- models a deployment names ------------------------------------------------------------------


def test_served_models_are_a_json_list_of_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENBUS_SERVED_MODELS", '["big", "small"]')
    assert TokenbusSettings().served_models == ("big", "small")
    monkeypatch.setenv("TOKENBUS_SERVED_MODELS", '["big", ""]')
    with pytest.raises(ValueError, match=r"served_models\.1"):
        TokenbusSettings()


def beat(worker_id: str, model: str, sent_at: float) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id,
        model=model,
        total_slots=4,
        free_slots=4,
        running=0,
        queued_tokens=0,
        utilisation=0.0,
        sent_at=sent_at,
    )


def test_the_edge_lets_a_named_model_through_while_none_of_its_workers_is_live() -> None:
    models = ModelDirectory(stale_s=10, listening_since=0.0, grace_s=3.0, pooled=frozenset({"big"}))
    models.observe(beat("w1", "small", 100.0), 100.0)
    assert models.unknown(ChatRequest(prompt="hi", model="big"), now=104.0) is None
    fallback = ChatRequest(prompt="hi", model="small", fallback_model="big")
    assert models.unknown(fallback, now=104.0) is None
    assert models.unknown(ChatRequest(prompt="hi", model="gpt-9"), now=104.0) == (
        "model",
        "model 'gpt-9' is not served here; available models: big, small",
    )


def test_the_edge_lists_a_pools_model_with_or_without_a_live_worker() -> None:
    models = ModelDirectory(
        stale_s=10, listening_since=50.0, grace_s=3.0, pooled=frozenset({"big"})
    )
    assert models.served(now=60.0) == {"big": 50}  # scaled to zero: listed all the same
    models.observe(beat("w1", "big", 100.0), 100.0)
    models.observe(beat("w2", "small", 100.0), 100.0)
    assert models.served(now=101.0) == {"big": 100, "small": 100}
    assert models.served(now=120.0) == {"big": 50}  # its workers gone: still a pool's model


def test_the_scheduler_knows_a_named_model_with_no_worker() -> None:
    check = ModelCheck(listening_since=NOW, grace_s=0.0)
    assert check.unknown("big", set(), NOW)
    assert not check.unknown("big", {"small"} | {"big"}, NOW)


# -- the worker's own measurement ---------------------------------------------------------------


def fake_proc(tmp_path: Path, uptime_s: float, start_ticks: int, name: str = "python") -> Path:
    (tmp_path / "self").mkdir()
    fields = ["S"] + ["0"] * 18 + [str(start_ticks)] + ["0"] * 10
    (tmp_path / "self" / "stat").write_text(f"4242 ({name}) {' '.join(fields)}\n")
    (tmp_path / "uptime").write_text(f"{uptime_s:.2f} 12.00\n")
    return tmp_path


def test_the_process_start_is_the_kernels(tmp_path: Path) -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    # Started 100 s after boot, 250 s ago; a command name with spaces and ")" in it.
    proc = fake_proc(tmp_path, uptime_s=350.0, start_ticks=100 * ticks, name="a ) b")
    before = time.time()
    started = process_started_at(proc)
    assert before - 250.0 - 0.5 <= started <= time.time() - 250.0 + 0.5


def test_the_process_start_where_proc_cannot_say_is_no_later_than_now(tmp_path: Path) -> None:
    assert process_started_at(tmp_path / "missing") <= time.time()
    assert process_started_at(Path("/proc")) <= time.time()


def test_load_seconds_are_never_negative() -> None:
    assert load_seconds(now=110.0, started_at=100.0) == 10.0
    assert load_seconds(now=99.0, started_at=100.0) == 0.0
