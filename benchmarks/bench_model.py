"""Random-weight benchmark checkpoints in HF format (config.json, safetensors, tokenizer.json).

The tokenizer is a word-level vocabulary of exactly `vocab_size` entries ("t0", "t1", ...): real
enough for vLLM, transformers and pdcluster to load and detokenize, and sized like a real model's.
"""

from __future__ import annotations

import json
import os
import pathlib

LLAMA_125M = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048)


def ensure_bench_model(path: str | os.PathLike, dtype: str = "bfloat16", **shape: int) -> str:
    path = pathlib.Path(path)
    if (path / "model.safetensors").exists():
        return str(path)
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = {**LLAMA_125M, **shape}
    path.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2", "unk_token": "t0"}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **cfg, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
              "tie_word_embeddings": False, "torch_dtype": dtype}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)
    tdt = getattr(torch, dtype)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def w(*s: int) -> torch.Tensor:
        return (torch.randn(*s, generator=g) * 0.02).to(tdt)

    t = {"model.embed_tokens.weight": w(v, h), "lm_head.weight": w(v, h), "model.norm.weight": torch.ones(h, dtype=tdt)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
              p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
              p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
              p + "mlp.down_proj.weight": w(h, inter),
              p + "input_layernorm.weight": torch.ones(h, dtype=tdt),
              p + "post_attention_layernorm.weight": torch.ones(h, dtype=tdt)}
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)
