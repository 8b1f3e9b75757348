"""Checkpoint shapes nobody picked by hand: seeded random tiny configs of the dense architectures,
served through the LLM API (scheduler, batching, chunked prefill, prefix cache, the CPU decode
driver for bfloat16 checkpoints, the eager layers for float32 ones), greedy tokens equal to
transformers' own generate on the same weights (float32 arithmetic on both sides).

The draws cover what the fixed tiny models do not: head dims of 8-64 (not powers of two too),
1-4 KV heads with 1-4 query heads each, an explicit head_dim that differs from hidden / heads,
intermediate sizes and vocabularies that are no multiple of the kernels' tiles, tied embeddings,
Llama's attention/MLP biases and rope scalings, Mistral's sliding window, block sizes 16/32 and
chunked prefill. Each config is printed with its seed, so a failure names what to rebuild.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from models.test_model_equivalence import hf_greedy
from tiny_models import randomize_biases, write_wordlevel_tokenizer

# Six draws in the default suite (~10 s), six more under -m slow.
SEEDS = [*range(6), *(pytest.param(s, marks=pytest.mark.slow) for s in range(6, 12))]
MAX_TOKENS = 24
_ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


def _classes(arch: str) -> tuple[type, type]:
    import transformers as tf

    tf.utils.logging.disable_progress_bar()
    return {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]


def draw(seed: int) -> tuple[str, dict[str, Any], torch.dtype, random.Random]:
    rng = random.Random(seed)
    arch = rng.choice(["llama", "mistral", "qwen2", "qwen3"])
    kv = rng.choice([1, 2, 3, 4])
    heads = kv * rng.choice([1, 2, 3, 4])
    head_dim = rng.choice([8, 12, 16, 20, 24, 32, 36, 40, 64])
    # Some draws keep hidden == heads * head_dim; the rest give head_dim explicitly (transformers
    # checks divisibility only when it is derived).
    hidden = heads * head_dim if rng.random() < 0.5 else heads * rng.choice([8, 12, 16, 24])
    cfg: dict[str, Any] = {
        "vocab_size": rng.choice([384, 401, 777, 1003]), "hidden_size": hidden, "head_dim": head_dim,
        "intermediate_size": rng.choice([50, 100, 130, 192, 257]), "num_hidden_layers": rng.choice([1, 2, 3]),
        "num_attention_heads": heads, "num_key_value_heads": kv, "max_position_embeddings": 512,
        "rms_norm_eps": rng.choice([1e-5, 1e-6]), "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": rng.random() < 0.3,
    }
    rope = rng.choice(sorted(_ROPES)) if arch == "llama" else "default"
    cfg["rope_parameters"] = {**_ROPES[rope], "rope_theta": rng.choice([10000.0, 500000.0, 1e6])}
    if arch == "llama":
        cfg["attention_bias"] = rng.random() < 0.4
        cfg["mlp_bias"] = rng.random() < 0.3
    if arch == "mistral" and rng.random() < 0.5:
        cfg["sliding_window"] = rng.choice([16, 40])
    return arch, cfg, rng.choice([torch.float32, torch.bfloat16]), rng


@pytest.mark.parametrize("seed", SEEDS)
def test_random_config_greedy_matches_transformers(seed: int, tmp_path) -> None:
    from pdcluster.engine.llm import LLM
    from pdcluster.kernels import decode_step_cpu
    from pdcluster.sampling_params import SamplingParams

    arch, cfg, dtype, rng = draw(seed)
    print(f"seed {seed}: {arch} {dtype} {cfg}")
    config_cls, model_cls = _classes(arch)
    torch.manual_seed(seed)
    randomize_biases(model_cls(config_cls(**cfg)), seed).to(dtype).eval().save_pretrained(str(tmp_path))
    write_wordlevel_tokenizer(tmp_path, cfg["vocab_size"])
    prompts = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(n)] for n in rng.sample([1, 5, 17, 33, 70, 130], 3)]

    # transformers in float32 (a bf16 checkpoint widened exactly): the arithmetic ours runs on a
    # CPU without bf16 instructions.
    ref = hf_greedy(str(tmp_path), prompts, MAX_TOKENS, dtype=torch.float32)

    llm = LLM(model=str(tmp_path), compute_dtype="float32", block_size=rng.choice([16, 32]),
              max_num_batched_tokens=rng.choice([64, 512]))
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        driver_steps = llm.engine.core.runner.model.model.decode_step.steps
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == ref
    if dtype == torch.bfloat16 and decode_step_cpu.available():
        # bf16 weights have exact bf16 decode copies: the one-call driver took the decode steps
        assert driver_steps > 0
    elif dtype == torch.float32:
        assert driver_steps == 0  # random float32 weights are not bf16 values: the eager layers ran


@pytest.mark.parametrize("overrides,named,rule", [
    ({"intermediate_size": 257}, "intermediate_size=257", False),
    ({"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 3}, "num_key_value_heads=3", True),
])
def test_tensor_parallel_refuses_shapes_it_cannot_split(tmp_path, overrides, named, rule) -> None:
    """Checked before any rank starts, naming the dimension; the KV-head rule (replication when
    there are fewer heads than ranks) is explained only when KV heads are the problem."""
    from tiny_models import make_tiny_checkpoint

    from pdcluster.config import EngineArgs

    path = make_tiny_checkpoint("llama", tmp_path / "ckpt", **overrides)
    with pytest.raises(ValueError) as e:
        EngineArgs(model=path, tensor_parallel_size=2, device="cpu").create_engine_config()
    message = str(e.value)
    assert named in message and "tensor_parallel_size=" in message
    assert ("replicated" in message) == rule
