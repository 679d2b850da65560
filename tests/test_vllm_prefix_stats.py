"""The vLLM engine's prefix-cache hit rate, from the stats vLLM hands its stat loggers.

vLLM is not installed here: the stats are fakes shaped as `vllm/v1/metrics/stats.py`'s
`SchedulerStats` / `PrefixCacheStats` (named as fakes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.engines.vllm import PrefixCacheWindow, stat_logger_factory


@dataclass
class FakePrefixCacheStats:
    requests: int
    queries: int
    hits: int
    reset: bool = False


@dataclass
class FakeSchedulerStats:
    prefix_cache_stats: FakePrefixCacheStats = field(
        default_factory=lambda: FakePrefixCacheStats(0, 0, 0)
    )


def test_hit_rate_is_hits_over_queries_of_the_last_requests() -> None:
    window = PrefixCacheWindow(max_requests=10)
    assert window.hit_rate is None
    window.observe(FakePrefixCacheStats(requests=5, queries=1000, hits=0))
    window.observe(FakePrefixCacheStats(requests=5, queries=1000, hits=900))
    assert window.hit_rate == 900 / 2000
    window.observe(FakePrefixCacheStats(requests=5, queries=1000, hits=1000))
    assert window.hit_rate == 1900 / 2000  # the first update left the window
    window.observe(FakePrefixCacheStats(requests=0, queries=0, hits=0, reset=True))
    assert window.hit_rate is None


def test_the_stat_logger_feeds_the_window_from_scheduler_stats() -> None:
    window = PrefixCacheWindow()
    logger = stat_logger_factory(window)(object(), 0)
    logger.record(FakeSchedulerStats(FakePrefixCacheStats(2, 100, 75)), None, 0)
    logger.record(None, None, 0)  # iteration-only updates carry no scheduler stats
    logger.log_engine_initialized()
    logger.log()
    assert window.hit_rate == 0.75
