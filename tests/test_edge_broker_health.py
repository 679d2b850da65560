"""The edge's view of the broker, with a plain clock: flips are reported once."""

from __future__ import annotations

from services.edge.broker_health import BrokerHealth


def test_reachable_until_a_call_fails_then_until_one_succeeds() -> None:
    health = BrokerHealth(retry_after_ms=2000)
    assert health.reachable
    assert health.succeeded(1.0) is False  # no change
    assert health.failed(2.0) is True
    assert health.failed(3.0) is False  # already down: reported once
    assert not health.reachable
    assert health.down_for(5.0) == 3.0
    assert health.succeeded(6.0) is True
    assert health.reachable
    assert health.down_for(7.0) == 0.0
