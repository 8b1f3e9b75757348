"""Phi-3 (Phi3ForCausalLM): a checkpoint with q/k/v and gate/up fused, split back by rows at load;
LongRoPE's cos/sin table equal to transformers' in both factor regimes, greedy output equal to
transformers' where transformers uses one factor set for the whole sequence (a context that fits
the original length; a prompt already past it); bad parameters and mismatched fused tensors refused
by name. The short-factor regime with a sliding window and partial rotary is in
test_model_equivalence.py (the tiny "phi3" there); TP=2 in tests/distributed/test_tp_equivalence.py."""

from __future__ import annotations

import json
import pathlib
import random

import pytest
import torch
import transformers
from tiny_models import greedy_ours_and_transformers, make_tiny_checkpoint

from pdcluster import LLM
from pdcluster.models.hf_config import load_model_config
from pdcluster.models.layers.rotary import RotaryEmbedding


def _hf_cos_sin(path: str, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    cos, sin = model.model.rotary_emb(torch.zeros(1, positions, 1), torch.arange(positions)[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("max_model_len,positions", [(32, 32), (256, 200)], ids=["short", "long"])
def test_cos_sin_table_equals_transformers(tmp_path: pathlib.Path, max_model_len: int, positions: int) -> None:
    """transformers picks the set from the forward's length: up to 32 the short one, past it the
    long one; ours is fixed by max_model_len against the original length (32)."""
    path = make_tiny_checkpoint("phi3", tmp_path / "p", original_max_position_embeddings=32)
    cfg = load_model_config(path, max_model_len=max_model_len)
    rot = RotaryEmbedding(cfg.rotary_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling_dict, rotary_op=None)
    cos, sin = _hf_cos_sin(path, positions)
    half = cfg.rotary_dim // 2
    ours = rot.cos_sin_cache[:positions]
    assert cfg.rotary_dim == 12 and dict(cfg.rope_scaling)["use_long"] == (max_model_len > 32)
    assert torch.allclose(ours[:, :half], cos[:, :half], atol=1e-6) and torch.allclose(ours[:, half:], sin[:, :half],
                                                                                       atol=1e-6)


def test_greedy_equals_transformers_in_both_regimes(tmp_path: pathlib.Path) -> None:
    path = make_tiny_checkpoint("phi3", tmp_path / "p", original_max_position_embeddings=32, sliding_window=None)
    rng = random.Random(0)
    long_prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (40, 57)]  # past 32 from the start
    got, want = greedy_ours_and_transformers(path, long_prompts, 16)
    assert got == want
    short_prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 14)]  # 14 + 16 < 32: all short
    got, want = greedy_ours_and_transformers(path, short_prompts, 16, max_model_len=32)
    assert got == want


def test_bad_longrope_and_fused_tensors_are_refused(tmp_path: pathlib.Path) -> None:
    path = pathlib.Path(make_tiny_checkpoint("phi3", tmp_path / "p"))
    raw = json.loads((path / "config.json").read_text())
    rope = raw["rope_parameters"]
    raw["rope_parameters"] = {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "su"}  # the old name
    (path / "config.json").write_text(json.dumps(raw))
    assert dict(load_model_config(str(path)).rope_scaling)["rope_type"] == "longrope"
    raw["rope_parameters"]["short_factor"] = [1.0, 2.0]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="longrope rope scaling: short_factor has 2 entries; the rotary dimension 12 "
                                         "needs 6"):
        load_model_config(str(path))
    raw["rope_parameters"]["short_factor"] = "wide"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="short_factor must be a list of positive numbers"):
        load_model_config(str(path))
    raw["rope_parameters"]["short_factor"] = [1.0] * 6
    raw["num_key_value_heads"] = 1  # the saved qkv_proj holds 2 KV heads' rows
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.qkv_proj.weight' has 128 rows; the config's "
                                         r"projections need 96"):
        LLM(model=str(path), device="cpu")
