"""A store hand-off between instances with different KV cache dtypes: the decode leg's producer
saved fp8 blocks under its key prefix (the fingerprint carries kv_dtype), so a float32 decode leg
finds a foreign prefix: counted, warned about naming kv_cache_dtype, and the prompt is computed
locally (never loaded as bytes of another dtype); its output is a float32 engine's."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
from store_engines import generate, greedy, settle

from pdcluster.config import EngineArgs
from pdcluster.connectors import engine_connector_factory
from pdcluster.connectors.testing import PREFILL_LEG
from pdcluster.engine.llm_engine import LLMEngine

# Eager where the engine has a compiled forward: the hand-off is the point here.
EAGER = {"enforce_eager": True} if "enforce_eager" in EngineArgs.__dataclass_fields__ else {}


def _engine(model: str, kv: str, options: dict[str, Any] | None) -> LLMEngine:
    args = EngineArgs(model=model, num_kv_blocks=64, max_model_len=512, block_size=16, seed=0, dtype="float32",
                      kv_cache_dtype=kv, kv_connector="store" if options is not None else None,
                      kv_connector_options=options, device="cpu", **EAGER)
    return LLMEngine.from_engine_args(args, connector=engine_connector_factory if options is not None else None)


def test_fp8_producer_float32_decode_leg_is_refused_and_computed(demo_model: str, kvstore_master: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random("kv-dtype-handoff")
    prompt = [rng.randrange(3, 500) for _ in range(3 * 16 + 5)]
    opts = {"master": kvstore_master, "namespace": "kv-dtype-handoff", "wait_for_producer_s": 5.0}
    producer, consumer, ref = _engine(demo_model, "fp8", opts), _engine(demo_model, "float32", opts), \
        _engine(demo_model, "float32", None)
    try:
        pre = generate(producer, {"r": prompt}, greedy(1), kv={"r": PREFILL_LEG})["r"]
        settle(producer)
        first = pre.outputs[0].token_ids
        with caplog.at_level(logging.WARNING):
            dec = generate(consumer, {"r": prompt}, greedy(6), kv={"r": pre.kv_transfer_params.for_decode_leg()},
                           prior={"r": first})["r"]
        settle(consumer)
        assert dec.error is None and dec.num_cached_tokens == 0
        stats = consumer.get_stats()["kv_connector"]
        assert stats["store_foreign_key_prefix"] == 1 and stats["store_hit_tokens"] == 0
        assert any("kv_cache_dtype" in r.getMessage() for r in caplog.records)
        want = generate(ref, {"w": prompt + first}, greedy(5))["w"].outputs[0].token_ids  # max_tokens counts the prior one
        assert dec.outputs[0].token_ids == want
    finally:
        for e in (producer, consumer, ref):
            e.shutdown()
