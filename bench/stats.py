"""The bench's one percentile, and the `Distribution` of a sample built on it.

Every percentile in bench/ and in the tests that report figures is `percentile` here:
linear interpolation between the closest ranks (Hyndman and Fan's type 7: numpy's default
`method="linear"`, `statistics.quantiles(method="inclusive")`). Chosen because most of
docs/benchmarks.md already came from it (capacity, policies, static live, fair share,
cache, the real engine, result topologies, and the chaos check's TTFT), and because
`vllm bench serve`, whose p99s stand next to ours in the vLLM side-by-side section, computes
its own with `numpy.percentile`, the same definition. Its p50 is the median.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from bench.report import Distribution


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The `q`th percentile (0-100) of `sorted_values`, ascending (module docstring)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q!r}: expected 0 to 100")
    rank = (len(sorted_values) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def distribution(values: Iterable[float]) -> Distribution:
    """Count, mean, p50, p95, p99 and max of `values` (empty: every statistic None)."""
    ordered = sorted(values)
    if not ordered:
        return Distribution()
    return Distribution(
        count=len(ordered),
        mean=_r(sum(ordered) / len(ordered)),
        p50=_r(percentile(ordered, 50)),
        p95=_r(percentile(ordered, 95)),
        p99=_r(percentile(ordered, 99)),
        max=_r(ordered[-1]),
    )


def percentiles(values: Iterable[float]) -> dict[str, float]:
    """n, min, p50, p90, p99 and max of a non-empty sample, as a plain dict (for JSON)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentiles of no values")
    return {
        "n": len(ordered),
        "min": ordered[0],
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "max": ordered[-1],
    }


def _r(value: float) -> float:
    return round(value, 3)
