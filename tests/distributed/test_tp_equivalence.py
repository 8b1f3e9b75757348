"""TP=2 (two real processes over gloo) gives the same tokens as TP=1, for every supported
architecture, in float32; shutdown leaves no rank process behind."""

from __future__ import annotations

import pytest
from distributed.tp_procs import wait_dead

from pdcluster import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 50)), [42, 17, 300, 2, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=6, ignore_eos=True)
ENGINE = {"num_kv_blocks": 48, "max_num_batched_tokens": 32}  # 32: the 40-token prompt is chunked


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}), ("llama2", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {}),
    ("qwen3", {"num_key_value_heads": 1}),  # fewer KV heads than ranks: the head is replicated
    ("llama", {"mlp_bias": True}),  # gate/up biases split with their rows, down's added once
    # q/k/v and gate/up fused in the checkpoint: each rank reads its rows of each (slow: the
    # default suite keeps one TP run per loader path; these add a fused split and multipliers).
    pytest.param("phi3", {}, marks=pytest.mark.slow),
    pytest.param("granite", {}, marks=pytest.mark.slow),  # multipliers on every rank's partial sums alike
], ids=["llama", "llama2", "mistral", "qwen2", "qwen3", "qwen3-kv1", "llama-mlp-bias", "phi3", "granite"])
def test_tp2_equals_tp1(tiny_ckpt, started_pids, arch: str, overrides: dict) -> None:
    path = tiny_ckpt(arch, **overrides)
    params = [GREEDY, GREEDY, SEEDED]
    ref = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(PROMPTS, params)]
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    runner = llm.engine.core.runner
    pids = list(runner.pids.values())
    started_pids.extend(pids)
    try:
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert out == ref
        # The KV cache of each rank holds only its KV heads (one when replicated).
        assert runner.runner.kv_caches.shape[4] == max(1, llm.engine.config.model.num_key_value_heads // 2)
        stats = runner.collective_stats()
        assert stats["num_steps"] >= 8 and stats["num_collectives"] > 0 and stats["collective_s"] > 0
    finally:
        llm.engine.shutdown()
    assert not runner.is_healthy()
    assert wait_dead(pids, 10.0) == []


def test_tp2_prompt_logprobs_equal_tp1(tiny_ckpt, started_pids) -> None:
    """Prompt logprobs run the LM head (an all-gather under TP) over every prompt position, on every
    rank in the same order: the same entries as one rank, in chunks (the 40-token prompt)."""
    path = tiny_ckpt("llama")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    ref = LLM(path, **ENGINE).generate(PROMPTS, params)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    started_pids.extend(llm.engine.core.runner.pids.values())
    try:
        out = llm.generate(PROMPTS, params)
    finally:
        llm.engine.shutdown()
    for got, want in zip(out, ref):
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) > 0
        for g, w in zip(got.prompt_logprobs, want.prompt_logprobs):
            assert g.sampled.token_id == w.sampled.token_id and g.sampled.rank == w.sampled.rank
            assert g.sampled.logprob == pytest.approx(w.sampled.logprob, abs=1e-4)
            assert [t.token_id for t in g.top] == [t.token_id for t in w.top]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_tp2_speculative_equals_tp1(tiny_ckpt, started_pids) -> None:
    """Rank 0 proposes n-gram drafts and broadcasts them with the step; every rank checks them on
    the same logits and keeps the same tokens: TP=2 with drafts equals TP=1 without."""
    path = tiny_ckpt("llama")
    prompts = [[5, 6, 7, 8, 9, 10] * 3, list(range(10, 30)) * 2]
    params = [GREEDY.replace(max_tokens=24), SEEDED.replace(max_tokens=24)]
    ref = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(prompts, params)]
    llm = LLM(path, tensor_parallel_size=2, speculative_config={"method": "ngram", "prompt_lookup_min": 1, "adaptive": False},
              **ENGINE)
    started_pids.extend(llm.engine.core.runner.pids.values())
    try:
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.get_stats()
    finally:
        llm.engine.shutdown()
    assert out == ref
    assert stats["spec_decode_draft_tokens"] > 0
