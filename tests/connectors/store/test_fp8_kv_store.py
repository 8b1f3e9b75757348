"""The store connector with an fp8 KV cache: two fp8 instances share blocks (the fp8 bytes are what
is stored and loaded), and a float32 instance on the same store never reads them (the key
fingerprint carries the KV dtype)."""

from __future__ import annotations

import random
from typing import Any

import torch
from store_engines import generate, greedy, settle, wait_events

from pdcluster.config import EngineArgs
from pdcluster.connectors import engine_connector_factory
from pdcluster.engine.llm_engine import LLMEngine


def _engine(model: str, kv: str, options: dict[str, Any] | None) -> LLMEngine:
    args = EngineArgs(model=model, num_kv_blocks=64, max_model_len=512, block_size=16, seed=0, dtype="float32",
                      kv_cache_dtype=kv, kv_connector="store" if options is not None else None,
                      kv_connector_options=options, device="cpu")
    return LLMEngine.from_engine_args(args, connector=engine_connector_factory if options is not None else None)


def test_fp8_blocks_round_trip_through_the_store(demo_model: str, kvstore_master: str) -> None:
    rng = random.Random("fp8-store")
    shared = [rng.randrange(3, 500) for _ in range(5 * 16 + 3)]
    prompt_a, prompt_b = shared + [rng.randrange(3, 500) for _ in range(9)], shared + [7, 8, 9, 10]
    opts = {"master": kvstore_master, "namespace": "fp8-store"}
    ref, a, b = _engine(demo_model, "fp8", None), _engine(demo_model, "fp8", opts), _engine(demo_model, "fp8", opts)
    f32 = _engine(demo_model, "float32", opts)
    try:
        assert a.core.runner.kv_caches.dtype == torch.float8_e4m3fn
        generate(a, {"a": prompt_a})
        settle(a)
        wait_events(a, 5)
        out_b = generate(b, {"b": prompt_b})["b"]
        settle(b)
        assert out_b.num_cached_tokens == 5 * 16  # the shared fp8 blocks came from the store
        want = generate(ref, {"ref-b": prompt_b}, greedy())["ref-b"]
        assert out_b.outputs[0].token_ids == want.outputs[0].token_ids
        out_f = generate(f32, {"f": prompt_b})["f"]
        settle(f32)
        assert out_f.num_cached_tokens == 0 and f32.get_stats()["kv_connector"]["store_hit_tokens"] == 0
    finally:
        for e in (ref, a, b, f32):
            e.shutdown()
