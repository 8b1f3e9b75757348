"""`pdcluster bench serve`: build the workload, drive the target, report like vLLM.

    flags -> tokenizer + PromptBuilder -> requests + send times -> initial test request
          -> --num-warmups warm-up requests (awaited, not measured)
          -> run_benchmark -> compute_metrics -> summary table (+ result JSON)
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import math
import sys
import time
import uuid
from dataclasses import dataclass, replace

import numpy as np

from pdcluster.cluster.bench.arrivals import arrival_offsets, trace_offsets
from pdcluster.cluster.bench.backend import DEFAULT_ENDPOINTS, Backend, BackendConfig, make_backend
from pdcluster.cluster.bench.cli import PERCENTILE_METRICS
from pdcluster.cluster.bench.datasets import load_jsonl, sample_prefix_repetition, sample_random
from pdcluster.cluster.bench.environment import collect_environment, parse_metadata
from pdcluster.cluster.bench.goodput import parse_goodput
from pdcluster.cluster.bench.metrics import compute_metrics
from pdcluster.cluster.bench.prompts import PromptBuilder
from pdcluster.cluster.bench.report import format_summary
from pdcluster.cluster.bench.request import BenchRequest
from pdcluster.cluster.bench.result import build_result, save_result
from pdcluster.cluster.bench.runner import RunResult, run_benchmark, with_request_ids
from pdcluster.cluster.bench.tokenizer import load_tokenizer
from pdcluster.cluster.bench.trace import read_trace, trace_requests

DEFAULT_NUM_PROMPTS = 1000
MAX_ERRORS_SHOWN = 10
# Warm-up prompts of a synthetic dataset are drawn with this seed offset: the same shape as the
# measured ones, other tokens, so a prefix cache cannot make the measured requests cheaper.
WARMUP_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Workload:
    requests: list[BenchRequest]
    send_offsets: np.ndarray  # seconds after the start


def parse_list(text: str, allowed: tuple[str, ...] | None = None, flag: str = "") -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if allowed is not None and s not in allowed]
    if bad:
        raise ValueError(f"{flag}: unknown {bad}; choose from {', '.join(allowed or ())}")
    return items


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(s) for s in parse_list(text)]
    except ValueError:
        raise ValueError(f"--metric-percentiles: {text!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0 <= v <= 100 for v in values):
        raise ValueError(f"--metric-percentiles must be numbers in [0, 100], got {text!r}")
    return values


def backend_config(args: argparse.Namespace) -> BackendConfig:
    backend = args.backend or ("pdcluster" if args.router else "openai")
    if backend == "pdcluster":
        target = args.router or f"{args.host}:{args.port}"
    else:
        base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
        target = base + (args.endpoint or DEFAULT_ENDPOINTS[backend])
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
    return BackendConfig(backend=backend, target=target, model=args.served_model_name or args.model,
                         ignore_eos=args.ignore_eos, temperature=args.temperature,
                         request_timeout=args.request_timeout)


def build_workload(args: argparse.Namespace, builder: PromptBuilder) -> Workload:
    dataset = "trace" if args.trace_file else args.dataset_name
    n = args.num_prompts
    if n is not None and n < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {n}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if dataset == "trace":
        path = args.trace_file or args.dataset_path
        if not path:
            raise ValueError("--dataset-name trace needs --trace-file")
        records = read_trace(path, n)
        requests = trace_requests(records, builder, seed=args.seed, block_size=args.trace_block_size)
        return Workload(requests, trace_offsets([r.timestamp_ms for r in records], args.trace_time_scale))
    if dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path")
        requests = load_jsonl(args.dataset_path, builder, n, args.jsonl_output_len)
    elif dataset == "random-mm":
        from pdcluster.cluster.bench.random_mm import sample_random_mm

        requests = sample_random_mm(
            builder, n or DEFAULT_NUM_PROMPTS, args.random_input_len, args.random_output_len, args.random_range_ratio,
            args.random_prefix_len, seed=args.seed, base_items=args.random_mm_base_items_per_request,
            items_range_ratio=args.random_mm_num_mm_items_range_ratio, limit=args.random_mm_limit_mm_per_prompt,
            buckets=args.random_mm_bucket_config)
    elif dataset == "prefix-repetition":
        requests = sample_prefix_repetition(
            builder, n or DEFAULT_NUM_PROMPTS, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, seed=args.seed)
    else:
        requests = sample_random(builder, n or DEFAULT_NUM_PROMPTS, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, args.random_prefix_len, seed=args.seed)
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, seed=args.seed)
    return Workload(requests, offsets)


def warmup_requests(args: argparse.Namespace, builder: PromptBuilder, workload: Workload | None,
                    n: int) -> list[BenchRequest]:
    """`n` requests shaped like the workload's, to be sent and awaited before it, never measured.

    Synthetic datasets (random, prefix-repetition) are sampled again with another seed; a file's
    requests (JSONL, trace) are reused in turn. Every one has its own id."""
    if n < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {n}")
    if n == 0:
        return []
    dataset = "trace" if args.trace_file else args.dataset_name
    if dataset in ("random", "random-mm", "prefix-repetition"):
        warm = copy.copy(args)
        warm.num_prompts, warm.seed = n, args.seed + WARMUP_SEED_OFFSET
        pool = build_workload(warm, builder).requests
    else:
        pool = list((workload or build_workload(args, builder)).requests)
    run = uuid.uuid4().hex[:8]
    return [replace(pool[i % len(pool)], request_id=f"bench-{run}-warmup-{i}") for i in range(n)]


async def send_warmups(backend: Backend, requests: list[BenchRequest], max_concurrency: int | None) -> RunResult:
    """All at once (at most --max-concurrency in flight), as vLLM's warm-up; awaited in full."""
    return await run_benchmark(backend, requests, np.zeros(len(requests)), max_concurrency, disable_tqdm=True)


def report_warmup(run: RunResult) -> None:
    failed = [r.error for r in run.results if not r.success]
    print(f"Warmup run completed: {len(run.results) - len(failed)}/{len(run.results)} requests in "
          f"{run.duration:.2f} s.")
    if failed:
        print(f"warning: {len(failed)} warm-up request(s) failed; first error: {failed[0]}", file=sys.stderr)


def _describe_traffic(args: argparse.Namespace, workload: Workload) -> str:
    if args.trace_file or args.dataset_name == "trace":
        span = float(workload.send_offsets[-1]) if len(workload.send_offsets) else 0.0
        return f"Traffic: trace replay of {len(workload.requests)} requests over {span:.1f} s"
    kind = "Poisson process" if args.burstiness == 1.0 else "gamma distribution"
    return (f"Traffic request rate: {args.request_rate}\n"
            f"Burstiness factor: {args.burstiness} ({kind})\n"
            f"Maximum request concurrency: {args.max_concurrency}")


async def _drive(args: argparse.Namespace, config: BackendConfig, workload: Workload,
                 warmups: list[BenchRequest]) -> tuple[RunResult, str | None]:
    async with make_backend(config) as backend:
        requests = with_request_ids(workload.requests)
        if not args.skip_initial_test:
            print("Starting initial single prompt test run...")
            # Its own id: a server may remember ids, and the first measured request reuses the prompt.
            probe = await backend.request(replace(requests[0], request_id=f"{requests[0].request_id}-probe"))
            if not probe.success:
                raise ValueError(f"initial test run failed; check the benchmark flags. Error: {probe.error}")
            print("Initial test run completed.")
        if warmups:
            print(f"Warming up with {len(warmups)} requests...")
            report_warmup(await send_warmups(backend, warmups, args.max_concurrency))
        print("Starting main benchmark run...")
        run = await run_benchmark(backend, requests, workload.send_offsets, args.max_concurrency,
                                  args.disable_tqdm)
        return run, getattr(backend, "model", None)


def run_serve(args: argparse.Namespace) -> int:
    slos = parse_goodput(args.goodput)
    percentile_metrics = parse_list(args.percentile_metrics, PERCENTILE_METRICS, "--percentile-metrics")
    percentiles = parse_percentiles(args.metric_percentiles)
    metadata = parse_metadata(args.metadata)
    config = backend_config(args)
    if args.dataset_name == "random-mm" and config.backend != "openai-chat" and not args.trace_file:
        raise ValueError("--dataset-name random-mm sends images as chat parts: use --backend openai-chat "
                         "(--endpoint /v1/chat/completions)")
    tokenizer_id = args.tokenizer or args.model
    if tokenizer_id is None:
        raise ValueError("--tokenizer (or --model as a local HF directory) is required to build prompts")
    builder = PromptBuilder(load_tokenizer(tokenizer_id))
    workload = build_workload(args, builder)
    warmups = warmup_requests(args, builder, workload, args.num_warmups)
    print(_describe_traffic(args, workload))
    if math.isfinite(args.request_rate) and (args.trace_file or args.dataset_name == "trace"):
        print("note: --request-rate and --burstiness are ignored when replaying a trace", file=sys.stderr)

    run, served_model = asyncio.run(_drive(args, config, workload, warmups))
    metrics = compute_metrics(run.results, run.duration, percentiles, slos or None, count_tokens=builder.count)
    failures = [r.error for r in run.results if not r.success]
    for i, error in enumerate(failures[:MAX_ERRORS_SHOWN]):
        print(f"Error {i}: {error}", file=sys.stderr)
    print(format_summary(metrics, percentile_metrics, args.max_concurrency, args.request_rate))

    result = build_result(
        metrics=metrics, results=run.results, run_start=run.start_time, backend=config.backend,
        model_id=args.model or served_model, tokenizer_id=str(tokenizer_id), num_prompts=len(workload.requests),
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        metadata=metadata, environment=collect_environment(metadata), label=args.label)
    result["num_warmups"] = len(warmups)
    if args.save_result:
        path = save_result(result, args.result_dir, args.result_filename, args.label)
        print(f"Result saved to {path}")
    return 0 if metrics.completed > 0 else 1


def run_warmup(args: argparse.Namespace, n: int) -> RunResult:
    """Only the warm-up of `bench serve`'s flags (no initial test, no measured run): `n` requests
    shaped like the workload, all at once, awaited. `bench sweep` runs it once per cluster."""
    config = backend_config(args)
    if args.dataset_name == "random-mm" and config.backend != "openai-chat" and not args.trace_file:
        raise ValueError("--dataset-name random-mm sends images as chat parts: use --backend openai-chat "
                         "(--endpoint /v1/chat/completions)")
    tokenizer_id = args.tokenizer or args.model
    if tokenizer_id is None:
        raise ValueError("--tokenizer (or --model as a local HF directory) is required to build prompts")
    builder = PromptBuilder(load_tokenizer(tokenizer_id))
    warmups = warmup_requests(args, builder, None, n)

    async def drive() -> RunResult:
        async with make_backend(config) as backend:
            return await send_warmups(backend, warmups, args.max_concurrency)

    start = time.perf_counter()
    run = asyncio.run(drive()) if warmups else RunResult([], 0.0, start)
    report_warmup(run)
    return run
