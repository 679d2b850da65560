"""The vLLM engine's prefix-cache hit rate, from the stats vLLM hands its stat loggers.

vLLM is not installed here: the stats are fakes shaped as `vllm/v1/metrics/stats.py`'s
`SchedulerStats` / `PrefixCacheStats` (named as fakes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from services.worker.engines.vllm import PrefixCacheWindow, SchedulerView, stat_logger_factory


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
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0


class FakeStatLoggerBase(ABC):
    """Shaped as vLLM 0.32's `StatLoggerBase`: abstract `__init__`, `record` (with
    `mm_cache_stats`) and `log_engine_initialized`, and hooks with defaults."""

    @abstractmethod
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None: ...

    @abstractmethod
    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None: ...

    @abstractmethod
    def log_engine_initialized(self) -> None: ...

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        self.slept = (is_awake, level)


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


def test_the_stat_logger_feeds_the_view_as_vllm_calls_it() -> None:
    """vLLM calls `record(scheduler_stats, iteration_stats, mm_cache_stats=, engine_idx=)`."""
    view = SchedulerView()
    logger_class = stat_logger_factory(view, FakeStatLoggerBase)
    logger = logger_class(object(), 0)  # vLLM constructs it: abstract methods all filled
    assert isinstance(logger, FakeStatLoggerBase)
    stats = FakeSchedulerStats(FakePrefixCacheStats(2, 100, 75), 3, 1, 0.5)
    logger.record(stats, None, mm_cache_stats=None, engine_idx=0)
    logger.record(None, object(), mm_cache_stats=object(), engine_idx=0)  # iteration-only
    logger.log_engine_initialized()
    logger.log()
    logger.record_sleep_state(1, 0)  # a hook of the base, inherited
    assert view.prefix_cache.hit_rate == 0.75
    assert (view.running, view.waiting, view.kv_cache_usage) == (3, 1, 0.5)
