"""The planned load: replayable from its seed, near its rates, every prompt its own text."""

from __future__ import annotations

from tests.chaos.load import plan_load


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
