"""The open-loop driver: send each request at its scheduled time, cap in-flight requests with
--max-concurrency, collect every result.

Open loop, as in vLLM: the schedule never waits for responses, so a slow server sees its queue
grow instead of a politely reduced load. With --max-concurrency, requests due while the cap is
reached wait on the client side; TTFT starts when a request is actually sent.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdcluster.cluster.bench.backend import Backend
from pdcluster.cluster.bench.request import BenchRequest, RequestResult


@dataclass(frozen=True)
class RunResult:
    results: list[RequestResult]  # in request order
    duration: float  # wall seconds from the start of the schedule until the last request finished
    start_time: float  # perf_counter() at the start of the schedule


def _progress(total: int, disable: bool) -> Any:
    try:  # tqdm is an optional dependency (the `bench` extra): no bar without it
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, disable=disable, desc="requests", unit="req")


async def _guarded(backend: Backend, req: BenchRequest) -> RequestResult:
    """The backend reports failures itself; this catches its bugs so one request cannot end the run."""
    start = time.perf_counter()
    try:
        return await backend.request(req)
    except Exception as e:
        return RequestResult(prompt_len=req.prompt_len, start_time=start, latency=time.perf_counter() - start,
                             error=f"{type(e).__name__}: {e}")


def with_request_ids(requests: Sequence[BenchRequest]) -> list[BenchRequest]:
    """Give every request an id unique across runs, so server logs and traces can be matched."""
    run = uuid.uuid4().hex[:8]
    return [r if r.request_id else replace(r, request_id=f"bench-{run}-{i}") for i, r in enumerate(requests)]


async def run_benchmark(backend: Backend, requests: Sequence[BenchRequest], send_offsets: Sequence[float],
                        max_concurrency: int | None = None, disable_tqdm: bool = False) -> RunResult:
    if len(requests) != len(send_offsets):
        raise ValueError(f"{len(requests)} requests but {len(send_offsets)} send times")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    pbar = _progress(len(requests), disable_tqdm)

    async def one(req: BenchRequest) -> RequestResult:
        if limit is None:
            result = await _guarded(backend, req)
        else:
            async with limit:
                result = await _guarded(backend, req)
        if pbar is not None:
            pbar.update(1)
        return result

    tasks: list[asyncio.Task[RequestResult]] = []
    start = time.perf_counter()
    try:
        for req, offset in zip(requests, send_offsets):
            delay = start + float(offset) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        end = time.perf_counter()
    finally:
        for t in tasks:  # on Ctrl-C or a crash: leave no request running behind the caller's back
            t.cancel()
        if pbar is not None:
            pbar.close()
    return RunResult(results=results, duration=end - start, start_time=start)
