"""The whole offline stack (LLM -> scheduler -> runner -> sampler -> detokenizer) against
transformers, and invariance of greedy outputs under every scheduling choice."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import hf_greedy

from pdcluster import LLM, SamplingParams
from pdcluster.config import EngineArgs

ARCHS = ["llama", "llama2", "mistral", "qwen2", "qwen3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_equals_transformers(tiny_ckpts, arch: str) -> None:
    path = tiny_ckpts(arch)
    llm = LLM(path, dtype="float32")
    prompts = _prompts(llm.engine.config.model.vocab_size, [1, 7, 16, 23, 40])
    ours = llm.generate(prompts, GREEDY)
    assert _tokens(ours) == hf_greedy(path, prompts, 32, torch.float32)
    assert all(o.outputs[0].finish_reason == "length" for o in ours)
    assert llm.engine.get_stats()["num_running"] == 0


@pytest.mark.parametrize(("arch", "cfg"), [
    ("llama", {}),
    ("qwen2", {}),  # biased q/k/v, a tied LM head
    ("llama", {"mlp_bias": True, "attention_bias": True}),  # biases on every projection
], ids=["llama", "qwen2", "llama-biases"])
def test_bf16_checkpoint_computed_in_float32_equals_transformers(tmp_path, arch: str, cfg: dict) -> None:
    """A bfloat16 checkpoint run in float32: decode steps read the bf16 decode copies
    (models/layers/cpu_gemv.py), prefill the float32 weights; greedy equals transformers in
    float32 on the same checkpoint, token for token."""
    from tiny_models import make_tiny_checkpoint

    from pdcluster.kernels import gemv_bf16_cpu
    from pdcluster.models.layers.cpu_gemv import copy_count

    if not gemv_bf16_cpu.available():
        pytest.skip("no C compiler on this machine")
    path = make_tiny_checkpoint(arch, tmp_path / arch, dtype=torch.bfloat16, **cfg)
    llm = LLM(path, dtype="float32")
    assert llm.engine.config.model.mlp_bias == bool(cfg.get("mlp_bias"))
    copies, _ = copy_count(llm.engine.core.runner.model)
    assert copies == 2 * 4 + 1  # per layer qkv, o, gate_up, down; the LM head
    prompts = _prompts(llm.engine.config.model.vocab_size, [1, 7, 16, 23, 40])
    assert _tokens(llm.generate(prompts, GREEDY)) == hf_greedy(path, prompts, 32, torch.float32)
    # The decode steps went through the one-call driver (models/cpu_decode_step.py).
    assert llm.engine.core.runner.model.model.decode_step.steps > 0


@pytest.fixture(scope="module")
def llama_case(tiny_ckpts):
    path = tiny_ckpts("llama")
    base = LLM(path, dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=4096)
    vocab = base.engine.config.model.vocab_size
    shared = _prompts(vocab, [37], seed=7)[0]
    prompts = _prompts(vocab, [5, 18, 33, 50]) + [shared + p for p in _prompts(vocab, [3, 17], seed=9)]
    return path, prompts, _tokens(base.generate(prompts, GREEDY))


@pytest.mark.parametrize("opts", [
    dict(enable_prefix_caching=True),
    dict(max_num_batched_tokens=8),
    dict(max_num_batched_tokens=13, block_size=5),
    dict(max_num_batched_tokens=64, block_size=1),
    dict(max_num_seqs=1),
    # A cache so small that running requests must be preempted and recomputed.
    dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=64),
    dict(long_prefill_token_threshold=7),  # every prompt chunk capped, whatever the budget
], ids=["prefix-cache", "chunk8", "chunk13-bs5", "chunk64-bs1", "one-seq", "preemption", "long-prefill-7"])
def test_greedy_invariant_under_scheduling(llama_case, opts: dict) -> None:
    path, prompts, expected = llama_case
    llm = LLM(path, dtype="float32", max_model_len=128, **opts)
    # Twice: the second round hits the prefix cache (when enabled) for every prompt.
    for _ in range(2):
        assert _tokens(llm.generate(prompts, GREEDY)) == expected
    stats = llm.engine.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0
    if opts.get("num_kv_blocks"):
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize(("opts", "message"), [
    (dict(long_prefill_token_threshold=-1), r"long_prefill_token_threshold must be an integer >= 0 \(0: off\), got -1"),
    (dict(long_prefill_token_threshold=8, enable_chunked_prefill=False), "needs enable_chunked_prefill"),
])
def test_long_prefill_token_threshold_is_checked_by_name(demo_model: str, opts: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=demo_model, **opts).create_engine_config()


def test_batch_composition_and_order(llama_case) -> None:
    path, prompts, expected = llama_case
    llm = LLM(path, dtype="float32")
    for i in (0, 3, 5):
        assert _tokens(llm.generate([prompts[i]], GREEDY)) == [expected[i]]
    rev = list(reversed(prompts))
    assert _tokens(llm.generate(rev, GREEDY)) == list(reversed(expected))


def test_prefix_cache_hits_are_counted(llama_case) -> None:
    path, prompts, _ = llama_case
    llm = LLM(path, dtype="float32", block_size=4)
    llm.generate(prompts[-2:], GREEDY)
    out = llm.generate(prompts[-1:], GREEDY)[0]
    assert out.num_cached_tokens >= 36  # the 37-token shared prefix, rounded down to full blocks
    assert llm.engine.get_stats()["prefix_cache_hit_rate"] > 0


def test_seeded_sampling_reproducible_whatever_the_batch(llama_case) -> None:
    path, prompts, _ = llama_case
    llm = LLM(path, dtype="float32")
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _tokens(llm.generate([prompts[1]], sp))[0]
    other = SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True)
    mixed = llm.generate([prompts[0], prompts[1], prompts[2]], [other, sp, other])
    assert mixed[1].outputs[0].token_ids == alone
    again = LLM(path, dtype="float32", max_num_batched_tokens=8)
    assert _tokens(again.generate([prompts[1]], sp))[0] == alone
    assert _tokens(llm.generate([prompts[1]], sp.replace(seed=1235)))[0] != alone


def test_stop_token_and_stop_string(demo_model: str) -> None:
    llm = LLM(demo_model)
    base = llm.generate(["Hello, world!"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    toks, text = base.outputs[0].token_ids, base.outputs[0].text
    stop_tok = toks[5]
    first = toks.index(stop_tok)
    out = llm.generate(["Hello, world!"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                          stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == toks[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    stop_str = text[len(text) // 2: len(text) // 2 + 3]
    assert stop_str
    cut = text.index(stop_str)
    out = llm.generate(["Hello, world!"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                          stop=[stop_str]))[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop_str
    out = llm.generate(["Hello, world!"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop_str],
                                                          include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == text[:cut + len(stop_str)]


@pytest.mark.parametrize("prompt, params, field", [
    ("", {}, "prompt"),
    ([], {}, "prompt"),
    ([5] * 300, {}, "max_model_len"),
    ([10**9], {}, "prompt_token_ids[0]"),
    ([1, -2], {}, "prompt_token_ids[1]"),
    ("hi", {"max_tokens": 0}, "max_tokens"),
    ("hi", {"temperature": -0.5}, "temperature"),
    ("hi", {"top_p": 0.0}, "top_p"),
    ("hi", {"top_p": 1.5}, "top_p"),
    ("hi", {"bogus_field": 1}, "bogus_field"),
])
def test_bad_input_names_the_field_and_engine_keeps_serving(demo_model: str, prompt, params, field) -> None:
    llm = _demo_llm(demo_model)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        llm.generate([prompt], SamplingParams(**params))
    ok = llm.generate(["still serving"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(ok.outputs[0].token_ids) == 4
    assert llm.engine.get_stats()["num_running"] == 0


_DEMO: dict[str, LLM] = {}


def _demo_llm(path: str) -> LLM:
    if path not in _DEMO:
        _DEMO[path] = LLM(path, max_model_len=256)
    return _DEMO[path]


def test_n_sequences_per_prompt(llama_case) -> None:
    """vLLM's SamplingParams(n=...): n sequences of each prompt in one RequestOutput; sequence j of
    a seeded request is the single-sequence run with seed + j; greedy ones are all alike."""
    path, prompts, _ = llama_case
    llm = LLM(path, dtype="float32", block_size=4)
    sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    outs = llm.generate(prompts[:2], sampled.replace(n=3))
    assert [len(o.outputs) for o in outs] == [3, 3]
    for o, prompt in zip(outs, prompts[:2], strict=True):
        assert [c.index for c in o.outputs] == [0, 1, 2]
        for j, seq in enumerate(o.outputs):
            alone = llm.generate([prompt], sampled.replace(seed=11 + j))[0].outputs[0]
            assert seq.token_ids == alone.token_ids, j
        assert len({tuple(c.token_ids) for c in o.outputs}) > 1  # the seeds differ, so do the samples
    greedy = llm.generate(prompts[:1], GREEDY.replace(n=2))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    with pytest.raises(ValueError, match=r"n must be in \[1, 16\]"):
        SamplingParams(n=17)
    with pytest.raises(ValueError, match="n must be 1 for one engine request"):
        llm.engine.prepare_request(prompts[0], GREEDY.replace(n=2))
    # vLLM's prompt dict may carry the cache salt.
    salted = {"prompt_token_ids": prompts[-1], "cache_salt": "t1"}
    llm.generate([salted], GREEDY)
    assert llm.generate([salted], GREEDY)[0].num_cached_tokens > 0
    assert llm.generate([{"prompt_token_ids": prompts[-1], "cache_salt": "t2"}], GREEDY)[0].num_cached_tokens == 0


def test_truncate_prompt_tokens_keeps_the_prompts_end(llama_case) -> None:
    """vLLM's truncate_prompt_tokens: the last k tokens (-1: as many as fit beside max_tokens)
    generate exactly what those tokens alone generate; a prompt too long without it is refused."""
    path, prompts, _ = llama_case
    llm = LLM(path, dtype="float32", block_size=4, max_model_len=40)
    long_prompt = prompts[3]  # 50 tokens: over this max_model_len
    with pytest.raises(ValueError, match="max_model_len=40"):
        llm.generate([long_prompt], GREEDY.replace(max_tokens=4))
    out = llm.generate([long_prompt], GREEDY.replace(max_tokens=4, truncate_prompt_tokens=20))[0]
    assert out.prompt_token_ids == long_prompt[-20:]
    assert out.outputs[0].token_ids == llm.generate([long_prompt[-20:]], GREEDY.replace(max_tokens=4))[0].outputs[0].token_ids
    out = llm.generate([long_prompt], GREEDY.replace(max_tokens=4, truncate_prompt_tokens=-1))[0]
    assert out.prompt_token_ids == long_prompt[-36:] and len(out.outputs[0].token_ids) == 4
    assert llm.generate([prompts[0]], GREEDY.replace(max_tokens=2, truncate_prompt_tokens=30))[0].prompt_token_ids == prompts[0]
    for bad in (0, -2, 2**31):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or in"):
            SamplingParams(truncate_prompt_tokens=bad)
