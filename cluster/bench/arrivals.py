"""When each request is sent: a seeded arrival process with vLLM's `--request-rate` and `--burstiness`.

Inter-arrival gaps are gamma distributed with shape `burstiness` and mean `1 / rate`:

    gap ~ Gamma(k = burstiness, theta = 1 / (rate * burstiness))     mean = 1/rate, CV = 1/sqrt(k)

burstiness 1.0 is a Poisson process (exponential gaps), < 1 is burstier, > 1 is more regular,
inf is a fixed interval. Like vLLM, the cumulative send times are rescaled so the last request is
sent at exactly `num_requests / rate`: short runs then offer the load that was asked for instead
of whatever the random draw gave, and the gap distribution's shape (its CV) is unchanged.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0,
                    normalize: bool = True) -> np.ndarray:
    """Send time of every request, in seconds after the benchmark starts (non-decreasing)."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if num_requests == 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(num_requests)  # everything at once
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        # A child stream of the seed: the datasets draw from the same --seed and must not share draws.
        rng = np.random.default_rng([seed, 0xA771])
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    if normalize and times[-1] > 0:
        times *= (num_requests / request_rate) / times[-1]
    return times


def trace_offsets(timestamps_ms: list[float] | np.ndarray, time_scale: float = 1.0) -> np.ndarray:
    """Replay times of a trace: its timestamps (ms) relative to the first one, times `time_scale`
    (0.5 replays twice as fast)."""
    if not time_scale >= 0 or math.isinf(time_scale):
        raise ValueError(f"--trace-time-scale must be a finite number >= 0, got {time_scale}")
    ts = np.asarray(timestamps_ms, dtype=np.float64)
    if ts.size == 0:
        return ts
    return (ts - ts[0]) / 1000.0 * time_scale
