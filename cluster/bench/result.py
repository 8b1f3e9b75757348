"""The result JSON, with vLLM's field names so existing plotting and comparison scripts read it.

Beyond vLLM's fields it holds mean/median/std/percentiles for all four latency metrics (vLLM
only writes those named by --percentile-metrics) and `environment`. Per-request lists (ttfts,
itls, latencies, start_times) are in seconds, as vLLM's; summary fields are in ms. JSON has no infinity, so
an infinite rate or burstiness is written as the string "inf", as vLLM does.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pdcluster.cluster.bench.metrics import LATENCY_METRICS, BenchmarkMetrics
from pdcluster.cluster.bench.request import RequestResult

DATE_FORMAT = "%Y%m%d-%H%M%S"


def percentile_word(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9": the key stem vLLM uses (p99_ttft_ms, p99.9_ttft_ms)."""
    return str(int(p)) if int(p) == p else str(p)


def _finite_or_str(x: float | None) -> float | str | None:
    return "inf" if x is not None and math.isinf(x) else x


def build_result(*, metrics: BenchmarkMetrics, results: Sequence[RequestResult], run_start: float, backend: str,
                 model_id: str | None, tokenizer_id: str | None, num_prompts: int, request_rate: float,
                 burstiness: float, max_concurrency: int | None, metadata: dict[str, str],
                 environment: dict[str, Any], label: str | None = None, date: datetime | None = None,
                 ) -> dict[str, Any]:
    out: dict[str, Any] = {
        "date": (date or datetime.now()).strftime(DATE_FORMAT),
        "endpoint_type": backend,  # vLLM keeps this older name of `backend` too
        "backend": backend,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": num_prompts,
    }
    out.update(metadata)  # vLLM puts --metadata at the top level; environment keeps a copy too
    out.update({
        "request_rate": _finite_or_str(request_rate),
        "burstiness": _finite_or_str(burstiness),
        "max_concurrency": max_concurrency,
        "duration": metrics.duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    })
    for name in LATENCY_METRICS:
        stats = metrics.latency(name)
        out[f"mean_{name}_ms"] = stats.mean
        out[f"median_{name}_ms"] = stats.median
        out[f"std_{name}_ms"] = stats.std
        for p, value in stats.percentiles:
            out[f"p{percentile_word(p)}_{name}_ms"] = value
    out.update({
        "input_lens": [r.prompt_len for r in results],
        "output_lens": list(metrics.output_lens),
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        # vLLM writes raw perf_counter() values; relative to the run's start they mean something.
        "start_times": [r.start_time - run_start if r.start_time else None for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "environment": environment,
    })
    return out


def default_filename(result: dict[str, Any], label: str | None = None) -> str:
    """vLLM's scheme: {label or backend}-{rate}qps[-concurrency{N}]-{model basename}-{date}.json"""
    concurrency = f"-concurrency{result['max_concurrency']}" if result.get("max_concurrency") is not None else ""
    model = (result.get("model_id") or "model").rstrip("/").split("/")[-1]
    rate = result["request_rate"]
    return f"{label or result['backend']}-{rate}qps{concurrency}-{model}-{result['date']}.json"


def save_result(result: dict[str, Any], result_dir: str | None = None, filename: str | None = None,
                label: str | None = None) -> pathlib.Path:
    path = pathlib.Path(filename or default_filename(result, label))
    if result_dir:
        os.makedirs(result_dir, exist_ok=True)
        path = pathlib.Path(result_dir) / path
    # Written whole, then renamed: a sweep reading the folder never sees half a file.
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, allow_nan=False)
    os.replace(tmp, path)
    return path
