from __future__ import annotations

import math

import numpy as np
import pytest

from pdcluster.cluster.bench.arrivals import arrival_offsets, trace_offsets


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
@pytest.mark.parametrize("normalize", [False, True])
def test_rate_and_burstiness_statistics(burstiness: float, normalize: bool) -> None:
    rate, n = 20.0, 40_000
    times = arrival_offsets(n, rate, burstiness, seed=7, normalize=normalize)
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # Gamma(k) gaps: coefficient of variation 1/sqrt(k); rescaling the sum keeps it.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_normalized_schedule_ends_at_n_over_rate() -> None:
    times = arrival_offsets(100, 4.0, 1.0, seed=1)
    assert times[-1] == pytest.approx(25.0)
    assert np.all(np.diff(times) >= 0)


def test_seeded_and_reproducible() -> None:
    a = arrival_offsets(50, 10.0, 0.5, seed=3)
    assert np.array_equal(a, arrival_offsets(50, 10.0, 0.5, seed=3))
    assert not np.array_equal(a, arrival_offsets(50, 10.0, 0.5, seed=4))


def test_infinite_rate_sends_everything_at_once() -> None:
    assert np.array_equal(arrival_offsets(5, math.inf), np.zeros(5))


def test_infinite_burstiness_is_a_fixed_interval() -> None:
    assert np.allclose(arrival_offsets(4, 2.0, math.inf), [0.5, 1.0, 1.5, 2.0])


def test_empty_and_invalid() -> None:
    assert arrival_offsets(0, 1.0).size == 0
    for rate, burstiness in [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (math.nan, 1.0)]:
        with pytest.raises(ValueError):
            arrival_offsets(3, rate, burstiness)


def test_trace_offsets_are_relative_and_scaled() -> None:
    assert np.allclose(trace_offsets([1000, 1500, 4000], 1.0), [0.0, 0.5, 3.0])
    assert np.allclose(trace_offsets([1000, 1500, 4000], 0.5), [0.0, 0.25, 1.5])
    assert trace_offsets([], 1.0).size == 0
    with pytest.raises(ValueError):
        trace_offsets([0], -1.0)
