"""The bench's one percentile (bench/stats.py): numpy's `linear`, checked against the stdlib."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.stats import distribution, percentile

samples = st.lists(
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=2, max_size=300
)


def test_percentile_interpolates_between_ranks() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


@given(samples, st.integers(min_value=1, max_value=99))
def test_percentile_is_the_inclusive_quantile_of_the_stdlib(values: list[float], q: int) -> None:
    ordered = sorted(values)
    expected = statistics.quantiles(ordered, n=100, method="inclusive")[q - 1]
    assert percentile(ordered, q) == pytest.approx(expected, rel=1e-9, abs=1e-6)


@given(samples)
def test_the_median_is_the_p50(values: list[float]) -> None:
    assert percentile(sorted(values), 50) == pytest.approx(statistics.median(values), abs=1e-6)


def test_no_values_or_a_percentile_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="expected 0 to 100"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="expected 0 to 100"):
        percentile([1.0], -1)


def test_a_distribution_takes_its_percentiles_from_percentile() -> None:
    values = [float(v) for v in range(1, 101)]
    d = distribution(reversed(values))
    assert (d.count, d.max) == (100, 100.0)
    assert (d.p50, d.p95, d.p99) == (50.5, 95.05, 99.01)
    empty = distribution([])
    assert (empty.count, empty.p99) == (0, None)
