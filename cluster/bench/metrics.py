"""From per-request timings to the benchmark summary, computed the way vLLM's benchmark does.

  TTFT  send -> first streamed chunk
  TPOT  (e2el - ttft) / (output_len - 1): time per output token after the first; requests with
        a single output token have no TPOT (they count as 0 for goodput only, like vLLM)
  ITL   every gap between consecutive streamed chunks, pooled over all requests
  E2EL  send -> last chunk
Statistics are numpy's: mean, median, std (population, ddof=0), percentile (linear). With no
samples every statistic is 0. Throughputs divide by the benchmark's wall-clock duration.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdcluster.cluster.bench.goodput import meets_slos
from pdcluster.cluster.bench.request import RequestResult

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class LatencyStats:
    """One latency metric in milliseconds; `percentiles` pairs (p, value)."""

    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, samples_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
        ms = np.asarray(samples_s, dtype=np.float64) * 1000.0 if len(samples_s) else np.zeros(1)
        return cls(mean=float(np.mean(ms)), median=float(np.median(ms)), std=float(np.std(ms)),
                   percentiles=tuple((float(p), float(np.percentile(ms, p))) for p in percentiles))


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float
    request_throughput: float
    request_goodput: float | None  # None when no --goodput was given
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float  # peak over 1-second windows
    max_concurrent_requests: int  # most requests in flight at one instant
    output_lens: tuple[int, ...]  # per request, 0 when it failed
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats

    def latency(self, name: str) -> LatencyStats:
        return getattr(self, name)


def tpot_of(result: RequestResult, output_len: int) -> float | None:
    if output_len <= 1:
        return None
    return (result.latency - result.ttft) / (output_len - 1)


def max_concurrency_observed(results: Sequence[RequestResult]) -> int:
    """Sweep of send (+1) and finish (-1) events; a request ending exactly when another starts
    does not overlap it."""
    events = sorted([(r.start_time, 1) for r in results] + [(r.end_time, -1) for r in results])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def peak_output_throughput(results: Sequence[RequestResult], output_lens: Sequence[int]) -> float:
    """Most output tokens finished within one 1-second window since the first send. A chunk's
    tokens are spread evenly over the request's chunks when it streamed several per chunk."""
    sent = [r.start_time for r in results]
    if not sent:
        return 0.0
    t0 = min(sent)
    per_second: Counter[int] = Counter()
    for r, n in zip(results, output_lens):
        times = r.chunk_times()
        if not times or n <= 0:
            continue
        for t in times:
            per_second[int(t - t0)] += n / len(times)
    return float(max(per_second.values(), default=0.0))


def compute_metrics(results: Sequence[RequestResult], duration: float, percentiles: Sequence[float],
                    slos_ms: dict[str, float] | None = None,
                    count_tokens: Callable[[str], int] | None = None) -> BenchmarkMetrics:
    """`count_tokens` counts output tokens of text for servers that report no usage."""
    if duration <= 0:
        raise ValueError(f"benchmark duration must be > 0, got {duration}")
    output_lens: list[int] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    total_input = good = 0
    for r in results:
        if not r.success:
            output_lens.append(0)
            continue
        n = r.output_len
        if n is None:
            n = count_tokens(r.generated_text) if count_tokens else 1 + len(r.itl)
        output_lens.append(n)
        total_input += r.prompt_len
        tpot = tpot_of(r, n)
        if tpot is not None:
            tpots.append(tpot)
        ttfts.append(r.ttft)
        itls.extend(r.itl)
        e2els.append(r.latency)
        if slos_ms and meets_slos(slos_ms, r.ttft, tpot or 0.0, r.latency):
            good += 1
    completed = len(ttfts)
    total_output = sum(output_lens)
    ok = [r for r in results if r.success]
    return BenchmarkMetrics(
        completed=completed, failed=len(results) - completed, total_input=total_input,
        total_output=total_output, duration=duration,
        request_throughput=completed / duration,
        request_goodput=good / duration if slos_ms else None,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        max_output_tokens_per_s=peak_output_throughput(ok, [n for r, n in zip(results, output_lens) if r.success]),
        # Failed requests held a slot too, for as long as they took to fail.
        max_concurrent_requests=max_concurrency_observed([r for r in results if r.start_time > 0]),
        output_lens=tuple(output_lens),
        ttft=LatencyStats.of(ttfts, percentiles), tpot=LatencyStats.of(tpots, percentiles),
        itl=LatencyStats.of(itls, percentiles), e2el=LatencyStats.of(e2els, percentiles),
    )
