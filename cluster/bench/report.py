"""The end-of-run summary table, laid out like vLLM's so people can diff the two by eye."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdcluster.cluster.bench.metrics import BenchmarkMetrics
from pdcluster.cluster.bench.result import percentile_word

WIDTH = 50
SECTIONS = {  # metric -> (section title, short name)
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _row(name: str, value: float | int) -> str:
    return f"{name:<40} {value:<10}" if isinstance(value, int) else f"{name:<40} {value:<10.2f}"


def format_summary(metrics: BenchmarkMetrics, percentile_metrics: Sequence[str],
                   max_concurrency: int | None = None, request_rate: float = math.inf) -> str:
    lines = [f"{' Serving Benchmark Result ':=^{WIDTH}}",
             _row("Successful requests:", metrics.completed),
             _row("Failed requests:", metrics.failed)]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(_row("Request rate configured (RPS):", float(request_rate)))
    lines += [
        _row("Benchmark duration (s):", metrics.duration),
        _row("Total input tokens:", metrics.total_input),
        _row("Total generated tokens:", metrics.total_output),
        _row("Request throughput (req/s):", metrics.request_throughput),
    ]
    if metrics.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", metrics.request_goodput))
    lines += [
        _row("Output token throughput (tok/s):", metrics.output_throughput),
        _row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s),
        _row("Peak concurrent requests:", float(metrics.max_concurrent_requests)),
        _row("Total token throughput (tok/s):", metrics.total_token_throughput),
    ]
    for name in [m for m in SECTIONS if m in percentile_metrics]:  # vLLM's order, whatever the flag's
        title, short = SECTIONS[name]
        stats = metrics.latency(name)
        lines.append(f"{title:-^{WIDTH}}")
        lines.append(_row(f"Mean {short} (ms):", stats.mean))
        lines.append(_row(f"Median {short} (ms):", stats.median))
        for p, value in stats.percentiles:
            lines.append(_row(f"P{percentile_word(p)} {short} (ms):", value))
    lines.append("=" * WIDTH)
    return "\n".join(lines)
