"""shared.metrics: lag per topic, GenAI latencies from `Timings`, tokens/s, /metrics serving."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from shared.messages import Timings
from shared.metrics import ConsumerLag, WorkerMetrics
from tests.fakes import FakeTopicPartition


@dataclass(frozen=True)
class FakeRecord:
    topic: str
    partition: int
    offset: int
    timestamp: int  # ms


class FakeConsumer:
    """Stands in for aiokafka's consumer: only the high watermarks."""

    def __init__(self, ends: dict[FakeTopicPartition, int]) -> None:
        self.ends = ends

    def highwater(self, tp: FakeTopicPartition) -> int | None:
        return self.ends.get(tp)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    assert found is not None, f"no sample {name}{labels}"
    return found


def test_lag_is_log_end_minus_position_summed_per_topic() -> None:
    registry = CollectorRegistry()
    lag = ConsumerLag.build(registry)
    a0, a1, b0 = FakeTopicPartition("a", 0), FakeTopicPartition("a", 1), FakeTopicPartition("b", 0)
    consumer = FakeConsumer({a0: 10, a1: 7, b0: 3})
    lag.observe(
        consumer,
        {
            a0: [FakeRecord("a", 0, 4, 1000_000), FakeRecord("a", 0, 5, 1000_500)],
            a1: [FakeRecord("a", 1, 6, 1001_000)],
            b0: [],
        },
        now=1002.0,
    )
    assert value(registry, "tokenbus_consumer_lag_records", topic="a") == (10 - 6) + (7 - 7)
    assert value(registry, "tokenbus_consumer_record_delay_seconds_count", topic="a") == 3
    assert value(registry, "tokenbus_consumer_record_delay_seconds_sum", topic="a") == 2 + 1.5 + 1
    # The partition caught up later: lag follows the newest position.
    consumer.ends[a0] = 12
    lag.observe(consumer, {a0: [FakeRecord("a", 0, 11, 1002_000)]}, now=1002.0)
    assert value(registry, "tokenbus_consumer_lag_records", topic="a") == 0


def test_worker_latencies_are_the_timings_of_chat_done() -> None:
    registry = CollectorRegistry()
    m = WorkerMetrics.build(registry)
    timings = Timings(queue_ms=12.0, batch_size=4, ttft_ms=50.0, total_ms=250.0)
    m.observe_done("interactive", timings, "length", input_tokens=7, output_tokens=11)
    t = {"tier": "interactive"}
    assert value(registry, "gen_ai_server_time_to_first_token_seconds_sum", **t) == 0.05
    assert value(registry, "gen_ai_server_request_duration_seconds_sum", **t) == 0.25
    assert value(registry, "tokenbus_request_queue_seconds_sum", **t) == 0.012
    # 200 ms of decode for the 10 tokens after the first.
    tpot = value(registry, "gen_ai_server_time_per_output_token_seconds_sum", **t)
    assert abs(tpot - 0.02) < 1e-9
    tokens = "tokenbus_worker_tokens_total"
    assert value(registry, tokens, tier="interactive", type="output") == 11
    assert value(registry, tokens, tier="interactive", type="input") == 7
    requests = "tokenbus_worker_requests_total"
    assert value(registry, requests, tier="interactive", outcome="length") == 1


def test_a_one_token_answer_has_no_inter_token_latency() -> None:
    registry = CollectorRegistry()
    m = WorkerMetrics.build(registry)
    timings = Timings(queue_ms=1, batch_size=1, ttft_ms=5, total_ms=5)
    m.observe_done("background", timings, "stop", input_tokens=3, output_tokens=1)
    assert registry.get_sample_value(
        "gen_ai_server_time_per_output_token_seconds_count", {"tier": "background"}
    ) in (None, 0.0)


def test_tokens_per_second_between_heartbeats() -> None:
    registry = CollectorRegistry()
    m = WorkerMetrics.build(registry)
    m.observe_capacity(running=0, total=64, now=10.0)
    m.count_tokens("interactive", 0, 300)
    m.observe_capacity(running=5, total=64, now=12.0)
    assert value(registry, "tokenbus_worker_output_tokens_per_second") == 150.0
    assert value(registry, "tokenbus_worker_slots_in_use") == 5
    assert value(registry, "tokenbus_worker_slots_capacity") == 64
