"""WorkerStats and WorkerInfo from the engine: what the router polls to route and to export.

The engine counts prefix-cache queries and hits since it started; routers want the recent hit
rate (a worker that warmed up an hour ago says little about now), so `HitRateWindow` keeps
samples of the cumulative counters and reports the rate over the last `window_s` seconds.

WorkerStats carries what routing needs; the rest of the engine's stats (the connector's counters,
CURVE refusals, token and step-time counters) is exported by the worker's Prometheus endpoint
(metrics_collector.py), read from the same snapshot.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdcluster._proto import common_pb2, worker_pb2

if TYPE_CHECKING:
    from pdcluster.engine.async_engine import AsyncEngine

DEFAULT_HIT_RATE_WINDOW_S = 60.0


class HitRateWindow:
    def __init__(self, window_s: float = DEFAULT_HIT_RATE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, queries, hits), cumulative

    def update(self, queries: int, hits: int) -> float:
        now = self._clock()
        self._samples.append((now, queries, hits))
        # Keep one sample at or before the window start: it is the baseline of the difference.
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        _, base_queries, base_hits = self._samples[0]
        window_queries, window_hits = queries - base_queries, hits - base_hits
        if window_queries <= 0:  # no admissions in the window: fall back to the lifetime rate
            return hits / queries if queries else 0.0
        return window_hits / window_queries


@dataclass(frozen=True)
class KVEventsInfo:
    """Where a worker publishes KV events; all empty when the publisher is disabled (no keys)."""

    events_endpoint: str = ""
    snapshot_endpoint: str = ""
    public_key: bytes = b""
    epoch: int = 0
    seq: int = 0


def build_stats(worker_id: str, role: int, model: str, block_size: int, stats: Mapping[str, Any],
                kv: KVEventsInfo, hit_rate: float) -> common_pb2.WorkerStats:
    total = int(stats.get("kv_blocks_total", 0))
    free = int(stats.get("kv_blocks_free", 0))
    return common_pb2.WorkerStats(
        worker_id=worker_id,
        role=role,
        model=model,
        num_running=int(stats.get("num_running", 0)),
        num_waiting=int(stats.get("num_waiting", 0)),
        num_waiting_for_remote_kv=int(stats.get("num_waiting_for_remote_kv", 0)),
        # The scheduler counts preemptions, not preempted requests waiting now; the waiting
        # count already includes those. Left 0 until the scheduler exposes it.
        num_preempted=int(stats.get("num_preempted", 0)),
        num_kv_blocks_total=total,
        num_kv_blocks_used=int(stats.get("kv_blocks_used", total - free)),
        num_kv_blocks_free=free,
        kv_usage=float(stats.get("kv_cache_usage", 0.0)),
        prefix_cache_hit_rate=hit_rate,
        block_size=block_size,
        kv_events_endpoint=kv.events_endpoint,
        kv_snapshot_endpoint=kv.snapshot_endpoint,
        kv_events_public_key=kv.public_key,
        kv_events_epoch=kv.epoch,
        kv_events_seq=kv.seq,
        timestamp=time.time(),
    )


def build_info(worker_id: str, role: int, engine: AsyncEngine, epoch: int, kv: KVEventsInfo,
               connector_name: str, version: str) -> worker_pb2.WorkerInfo:
    """From the engine's frozen EngineConfig and EOS ids."""
    cfg = engine.config
    return worker_pb2.WorkerInfo(
        worker_id=worker_id,
        role=role,
        model=cfg.model.model_path,
        dtype=cfg.model.dtype,
        kv_cache_dtype=cfg.cache.kv_cache_dtype,
        block_size=cfg.cache.block_size,
        max_model_len=cfg.scheduler.max_model_len,
        tp_size=cfg.parallel.tensor_parallel_size,
        num_kv_blocks_total=cfg.cache.num_blocks,
        kv_connector=connector_name,
        engine_epoch=epoch,
        version=version,
        kv_events_endpoint=kv.events_endpoint,
        kv_snapshot_endpoint=kv.snapshot_endpoint,
        kv_events_public_key=kv.public_key,
        eos_token_ids=list(engine.eos_token_ids),
        ec_connector=getattr(cfg, "ec_connector", "") or "",
        **_ec_endpoint_fields(engine),
    )


def _ec_endpoint_fields(engine: AsyncEngine) -> dict[str, object]:
    """The EC producer endpoint, where this worker has one (stand-in engines may have no ec_endpoint)."""
    get = getattr(engine, "ec_endpoint", None)
    endpoint = get() if callable(get) else None
    if not endpoint:
        return {}
    address, public_key = endpoint
    return {"ec_endpoint": address, "ec_public_key": public_key}
