"""Store connector options: EngineArgs.kv_connector_options, checked once into a frozen dataclass.

    backend              "kvstore" (default, the built-in store) | "mooncake"
    master               kvstore master HOST:PORT (default 127.0.0.1:50070); tls_ca/tls_cert/tls_key,
                         replica_num, num_streams, use_shm, rpc_timeout_s: the kvstore client's
    mooncake_*           Mooncake Store settings (mooncake_backend.py)
    namespace            first part of every key (tenants or deployments sharing one store)
    model_id             identity of the weights in the key fingerprint (default: the model
                         directory's name + architecture); set it when different weights share a name
    layout               "LBHNC" (default, head-major) | "LBNHC" (token-major)
    store_tp_size        logical shards per block (part of every key: instances share blocks only
                         when they agree on it); default gcd(lcm(tp_sizes), num KV heads)
    tp_sizes             TP sizes of the instances sharing the store, the same list on every one of
                         them (default [1, 2, 4, 8] plus this instance's TP: instances of any of
                         those sizes share keys without configuration, e.g. a TP=2 prefill pool and
                         a TP=1 decode pool). A deployment of one TP size can give just that size
                         (fewer, larger objects per block: [1] stores each block as one object);
                         one with a TP above 8 must list its sizes on every instance
    load, save           read from / write to the store (default both: any instance reuses any prefix)
    save_decode_blocks   also save blocks filled by generated tokens (default True: multi-turn reuse)
    failure_policy       "recompute" (default: a store is a cache, an object evicted between lookup
                         and read is an expected miss) | "fail"
    wait_for_producer_s  a decode leg whose params promise stored tokens waits this long for the
                         producer's saves to land before computing them itself (default 5)
    save_staging_mib, load_staging_mib   staging arenas per rank
    save_wait_s          a step whose saves overflow staging waits this long for room, then drops the rest
    event_poll_s         how often saved blocks are checked complete before a BlockStored event
    retry_after_error_s  after a failed lookup, skip the store this long (no stall per request)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pdcluster.config import EngineConfig
from pdcluster.dtypes import ITEMSIZE

from .backend_factory import BACKENDS
from .layout import LAYOUTS, StoreLayout, default_store_tp_size

BACKEND_KEYS = {"master", "replica_num", "num_streams", "use_shm", "rpc_timeout_s", "tls_ca", "tls_cert", "tls_key",
                "object_key",  # the workers' store key (hex): kvstore objects are MACed under it
                "mooncake_master", "mooncake_metadata_server", "mooncake_protocol", "mooncake_rdma_devices",
                "mooncake_local_hostname", "mooncake_segment_bytes", "mooncake_buffer_bytes"}
_FLOATS = ("wait_for_producer_s", "event_poll_s", "retry_after_error_s", "save_wait_s")
_INTS = ("save_staging_mib", "load_staging_mib")
_BOOLS = ("load", "save", "save_decode_blocks")
# TP sizes assumed to share the store when the tp_sizes option is not given (every power of two a
# single 8-accelerator node runs): store_tp_size is then the same on all of them.
DEFAULT_TP_SIZES = (1, 2, 4, 8)
_KNOWN = BACKEND_KEYS | set(_FLOATS) | set(_INTS) | set(_BOOLS) | {
    "backend", "namespace", "model_id", "layout", "store_tp_size", "tp_sizes", "failure_policy"}


@dataclass(frozen=True)
class StoreOptions:
    layout: StoreLayout
    backend: str = "kvstore"
    backend_options: dict[str, Any] = field(default_factory=dict)
    load: bool = True
    save: bool = True
    save_decode_blocks: bool = True
    failure_policy: str = "recompute"
    wait_for_producer_s: float = 5.0
    save_staging_mib: int = 64
    load_staging_mib: int = 32
    save_wait_s: float = 5.0
    event_poll_s: float = 0.05
    retry_after_error_s: float = 1.0

    @classmethod
    def from_dict(cls, options: dict[str, Any], engine_config: EngineConfig) -> StoreOptions:
        unknown = sorted(set(options) - _KNOWN)
        if unknown:
            raise ValueError(f"unknown store connector option(s) {unknown}; known: {sorted(_KNOWN)}")
        o = options
        backend = str(o.get("backend", "kvstore"))
        if backend not in BACKENDS:
            raise ValueError(f"store backend must be one of {BACKENDS}, got {backend!r}")
        policy = str(o.get("failure_policy", "recompute"))
        if policy not in ("fail", "recompute"):
            raise ValueError(f"failure_policy must be 'fail' or 'recompute', got {policy!r}")
        kw: dict[str, Any] = {}
        for name in _FLOATS:
            if name in o:
                kw[name] = _number(name, o[name], allow_zero=True)
        for name in _INTS:
            if name in o:
                kw[name] = int(_number(name, o[name], allow_zero=False))
        for name in _BOOLS:
            if name in o:
                if not isinstance(o[name], bool):
                    raise ValueError(f"store option {name} must be true or false, got {o[name]!r}")
                kw[name] = o[name]
        return cls(layout=build_layout(o, engine_config), backend=backend,
                   backend_options={k: v for k, v in o.items() if k in BACKEND_KEYS}, failure_policy=policy, **kw)


def build_layout(o: dict[str, Any], engine_config: EngineConfig) -> StoreLayout:
    """The StoreLayout every rank and the scheduler side of this instance agree on."""
    m, c = engine_config.model, engine_config.cache
    local_tp = engine_config.parallel.tensor_parallel_size
    layout = str(o.get("layout", "LBHNC"))
    if layout not in LAYOUTS:
        raise ValueError(f"store layout must be one of {LAYOUTS}, got {layout!r}")
    tp_sizes = o.get("tp_sizes")
    if tp_sizes is None:
        # Not the local TP alone: then a TP=2 and a TP=1 instance would cut blocks into different
        # shards, name them differently, and silently never share one.
        tp_sizes = sorted({*DEFAULT_TP_SIZES, local_tp})
    if not isinstance(tp_sizes, (list, tuple)) or not tp_sizes \
            or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tp_sizes):
        raise ValueError(f"store option tp_sizes must be a non-empty list of positive integers, got {tp_sizes!r}")
    if local_tp not in tp_sizes:
        raise ValueError(f"store option tp_sizes={list(tp_sizes)} must include this instance's "
                         f"tensor_parallel_size={local_tp}")
    store_tp = o.get("store_tp_size")
    if store_tp is None:
        store_tp = default_store_tp_size(tp_sizes, m.num_key_value_heads)
    elif isinstance(store_tp, bool) or not isinstance(store_tp, int) or store_tp < 1:
        raise ValueError(f"store_tp_size must be a positive integer, got {store_tp!r}")
    if c.kv_cache_dtype not in ITEMSIZE:
        raise ValueError(f"the store connector cannot move a {c.kv_cache_dtype!r} KV cache")
    model_id = str(o.get("model_id") or f"{os.path.basename(os.path.normpath(m.model_path))}:{m.architecture}")
    kv_scales = ""
    if ITEMSIZE[c.kv_cache_dtype] == 1:  # fp8: stored bytes are value / scale, so keys name the scales
        from pdcluster.models.layers.kv_quant import kv_scales_digest  # lazy: torch

        kv_scales = kv_scales_digest(m.model_path, m.num_hidden_layers, m.num_key_value_heads)
    out = StoreLayout(model_id=model_id, num_layers=m.num_hidden_layers, total_num_kv_heads=m.num_key_value_heads,
                      head_dim=m.head_dim, block_size=c.block_size, kv_dtype=c.kv_cache_dtype,
                      itemsize=ITEMSIZE[c.kv_cache_dtype], store_tp_size=int(store_tp), layout=layout,
                      compute_dtype=m.dtype, namespace=str(o.get("namespace", "pdcluster")), kv_scales=kv_scales)
    out.check_tp(local_tp)
    return out


def _number(name: str, value: Any, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"store option {name} must be a {'non-negative' if allow_zero else 'positive'} number, "
                         f"got {value!r}")
    return float(value)


__all__ = ["DEFAULT_TP_SIZES", "StoreOptions", "build_layout"]
