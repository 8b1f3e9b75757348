"""A windowed model in a KV pool smaller than its sequences: with every layer sliding a request of
any length needs only its window's blocks (kv_window.min_pool_blocks), so config and admission
accept a pool much smaller than max_model_len and a long generation is token-exact vs
transformers; a full-attention model in the same pool is still refused, naming the pool."""

from __future__ import annotations

import pytest
from models.test_model_equivalence import hf_greedy, make_prompts
from models.tiny_archs import make_checkpoint

from pdcluster import LLM, SamplingParams
from pdcluster.config import EngineArgs
from pdcluster.engine.kv_window import min_pool_blocks

BS, WINDOW = 3, 5  # min_pool_blocks = ceil(4 / 3) + 1 = 3
EAGER = {"enforce_eager": True} if "enforce_eager" in EngineArgs.__dataclass_fields__ else {}


@pytest.mark.parametrize("pool,mnbt", [(min_pool_blocks(WINDOW, BS), 64), pytest.param(5, 7, marks=pytest.mark.slow)], ids=["min-pool", "pool5-chunk7"])
def test_long_generation_in_a_pool_smaller_than_its_length(tmp_path, pool: int, mnbt: int) -> None:
    path = make_checkpoint("mistral", tmp_path / "m", sliding_window=WINDOW, max_position_embeddings=256)
    prompts = make_prompts(384, lens=(26, 8), seed=11)
    max_tokens = 40  # 66 tokens = 22 blocks for the longer one, in a pool of 3 or 5
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, max_model_len=256, num_kv_blocks=pool,
              max_num_batched_tokens=mnbt, **EAGER)
    sched = llm.engine.core.scheduler
    assert sched.kv.sliding_window == WINDOW and sched.kv.num_blocks == pool
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, max_tokens)
    assert llm.engine.get_stats()["kv_blocks_used"] == 0


def test_full_attention_still_needs_the_whole_sequence(tmp_path) -> None:
    path = make_checkpoint("mistral", tmp_path / "l", sliding_window=None, max_position_embeddings=256)
    with pytest.raises(ValueError, match=r"cannot hold one sequence of max_model_len=256"):
        LLM(path, dtype="float32", device="cpu", block_size=BS, max_model_len=256, num_kv_blocks=5, **EAGER)
    # Qwen2 with a full-attention layer (max_window_layers=1) frees nothing: refused the same way.
    q2 = make_checkpoint("qwen2", tmp_path / "q", use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1, max_position_embeddings=256)
    with pytest.raises(ValueError, match=r"cannot hold one sequence"):
        LLM(q2, dtype="float32", device="cpu", block_size=BS, max_model_len=256, num_kv_blocks=5, **EAGER)
    # A windowed pool below one window's blocks is refused too, by config.
    m = make_checkpoint("mistral", tmp_path / "m", sliding_window=WINDOW, max_position_embeddings=256)
    with pytest.raises(ValueError, match=r"cannot hold one sequence"):
        LLM(m, dtype="float32", device="cpu", block_size=BS, max_model_len=256, num_kv_blocks=2, **EAGER)
