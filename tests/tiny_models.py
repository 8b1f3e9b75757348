"""Tiny random-weight HF checkpoints for equivalence tests, built and saved by transformers itself.

    make_tiny_checkpoint("qwen3", tmp_path / "q3")  ->  a directory loadable by both transformers
    (AutoModelForCausalLM.from_pretrained) and pdcluster (load_model_config + load_model).
"""

from __future__ import annotations

import os
from typing import Any

import torch

TINY_COMMON: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    # Wider than the default 0.02 so greedy decoding wanders over the vocabulary instead of
    # repeating one token: a stronger equivalence check.
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the tiny model's wavelengths fall in all three llama3 bands.
    "original_max_position_embeddings": 64,
}

TINY_ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"rope_parameters": LLAMA3_ROPE},
    "llama2": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "num_key_value_heads": 4},
    "mistral": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "qwen2": {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    # head_dim 32 != hidden 64 / 4 heads.
    "qwen3": {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    # Fused qkv/gate_up in the checkpoint, a window every layer, 3/4 of each head rotated, and LongRoPE's
    # short factors (the original length is the whole context: transformers never switches to the long ones).
    "phi3": {"sliding_window": 40, "original_max_position_embeddings": 256, "pad_token_id": 0,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                 "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.5],
                                 "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}},
    # Every multiplier away from 1 (the attention one is the softmax scale itself), MLP biases on.
    "granite": {"embedding_multiplier": 6.0, "residual_multiplier": 0.4, "attention_multiplier": 0.2,
                "logits_scaling": 3.0, "mlp_bias": True, "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}


def _classes(arch: str) -> tuple[type, type]:
    import transformers as tf

    tf.utils.logging.disable_progress_bar()  # no "Writing model shards" bars in test output

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "llama2": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
    }[arch]


def make_tiny_checkpoint(arch: str, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                         shard: bool = False, seed: int = 0, **config_overrides: Any) -> str:
    """Build a seeded random tiny `arch` model with transformers and save it (safetensors) at path."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {sorted(TINY_ARCHS)}")
    config_cls, model_cls = _classes(arch)
    kwargs = {**TINY_COMMON, **TINY_ARCHS[arch], **config_overrides}
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = randomize_biases(model_cls(config), seed).to(dtype).eval()
    model.save_pretrained(str(path), max_shard_size="40KB" if shard else "2GB")
    write_wordlevel_tokenizer(path, model.config.vocab_size)
    return str(path)


def randomize_biases(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every bias random values: transformers initialises biases to zeros, so a checkpoint
    straight from it cannot tell a bias that is added from one that is dropped or misplaced."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=g))
    return model


def write_wordlevel_tokenizer(path: str | os.PathLike, vocab_size: int) -> None:
    """A real tokenizer.json whose vocabulary is exactly the model's ("t0" .. "tN", space separated),
    so text prompts and detokenization work on tiny random checkpoints."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(os.path.join(str(path), "tokenizer.json"))
    with open(os.path.join(str(path), "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}, f)


def hf_greedy(path: str, prompts: list[list[int]], max_tokens: int,
              dtype: torch.dtype | None = None) -> list[list[int]]:
    """transformers' own greedy generation, eos ignored, one prompt at a time (no padding effects).
    dtype: load in it (float32 widens a bf16 checkpoint exactly); None: transformers' default."""
    import transformers

    kwargs = {} if dtype is None else {"dtype": dtype}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop early, never mask eos
    outs = []
    for p in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
        assert len(outs[-1]) == max_tokens
    return outs


def greedy_ours_and_transformers(path: str, prompts: list[list[int]], new: int,
                                 **engine: Any) -> tuple[list[list[int]], list[list[int]]]:
    """(ours, transformers') greedy tokens of each prompt, eos ignored: transformers' from
    hf_greedy, ours as one offline batch with these engine options."""
    from pdcluster import LLM, SamplingParams

    want = hf_greedy(path, prompts, new)
    llm = LLM(model=path, device="cpu", **engine)
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                   SamplingParams(temperature=0, max_tokens=new,
                                                                                  ignore_eos=True))]
    finally:
        llm.shutdown()
    return got, want
