"""YaRN rope scaling (Qwen2.5/Qwen3 long-context configs): the cos/sin table equals transformers'
rotary embedding bit for bit, greedy output equals transformers', and bad parameters are refused
by name. Dynamic NTK too: plain rope up to max_position_embeddings, as in transformers."""

from __future__ import annotations

import json
import pathlib
import random
from typing import Any

import pytest
import torch
import transformers
from tiny_models import greedy_ours_and_transformers, make_tiny_checkpoint

from pdcluster.models.hf_config import load_model_config
from pdcluster.models.layers.rotary import RotaryEmbedding

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {
    "plain": YARN,
    # DeepSeek-style temperature from mscale / mscale_all_dim, narrower ramp.
    "mscale": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    "attention_factor": {**YARN, "factor": 2.0, "attention_factor": 1.3, "truncate": False},
    "qwen_long": {**YARN, "rope_theta": 1000000.0, "original_max_position_embeddings": 32},
}


def _hf_cos_sin(path: str, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(config)
    rot = model.model.rotary_emb
    x = torch.zeros(1, positions, 1, dtype=torch.float32)
    cos, sin = rot(x, torch.arange(positions)[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_table_equals_transformers(variant: str, tmp_path: pathlib.Path) -> None:
    path = make_tiny_checkpoint("llama2", tmp_path / variant, rope_parameters=VARIANTS[variant])
    cfg = load_model_config(path)
    assert cfg.rope_scaling_dict["rope_type"] == "yarn"
    rot = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling_dict, rotary_op=None)
    cos, sin = _hf_cos_sin(path, cfg.max_model_len)
    half = cfg.head_dim // 2
    ours = rot.cos_sin_cache
    assert torch.equal(ours[:, :half], cos[:, :half]) and torch.equal(ours[:, half:], sin[:, :half])
    plain = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, cfg.rope_theta, None, rotary_op=None)
    assert not torch.allclose(plain.cos_sin_cache, ours, atol=1e-3)  # the scaling is really applied


def _greedy_ours_and_transformers(path: str, lens: tuple[int, ...], new: int) -> tuple[list, list]:
    rng = random.Random(0)
    return greedy_ours_and_transformers(path, [[rng.randrange(3, 384) for _ in range(n)] for n in lens], new)


def test_greedy_equals_transformers(tmp_path: pathlib.Path) -> None:
    path = make_tiny_checkpoint("qwen3", tmp_path / "q3", rope_parameters={**YARN, "rope_theta": 1000000.0})
    got, want = _greedy_ours_and_transformers(path, (9, 40), 16)
    assert got == want


def test_dynamic_ntk_equals_transformers_up_to_max_position_embeddings(tmp_path: pathlib.Path) -> None:
    """transformers' dynamic NTK rescales the base only past max_position_embeddings, which
    max_model_len never exceeds: greedy output to the very last position equals transformers'."""
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    path = make_tiny_checkpoint("llama2", tmp_path / "dyn", rope_parameters=rope, max_position_embeddings=64)
    cfg = load_model_config(path)
    assert cfg.rope_scaling is None and cfg.max_model_len == 64
    got, want = _greedy_ours_and_transformers(path, (5, 40), 24)  # 40 + 24 = the 64th position
    assert got == want
    with pytest.raises(ValueError, match=r"max_model_len \(65\) exceeds the model's max_position_embeddings \(64\)"):
        load_model_config(path, max_model_len=65)


def _config_dir(path: pathlib.Path, rope: dict[str, Any], **top: Any) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "max_position_embeddings": 128, "rope_scaling": rope, **top}))
    from safetensors.torch import save_file

    save_file({}, str(path / "model.safetensors"))
    return str(path)


def test_parameters_parsed_and_checked(tmp_path: pathlib.Path) -> None:
    # The older spelling ("type"), and a top-level original length (Phi-3 style) that wins.
    cfg = load_model_config(_config_dir(tmp_path / "a", {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64},
                                        original_max_position_embeddings=32))
    assert cfg.rope_scaling_dict == {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32}
    cfg = load_model_config(_config_dir(tmp_path / "b", {"rope_type": "yarn", "factor": 2.0, "beta_fast": 8,
                                                         "truncate": False, "unrelated": "x"}))
    assert cfg.rope_scaling_dict == {"rope_type": "yarn", "factor": 2.0, "beta_fast": 8, "truncate": False,
                                     "original_max_position_embeddings": 128}
    bad = [({}, "yarn rope scaling is missing 'factor'"), ({"factor": 0.5}, "factor must be >= 1"), ({"factor": "4"}, "factor must be a positive number"),
           ({"factor": 2.0, "beta_slow": -1}, "beta_slow must be a positive number"),
           ({"factor": 2.0, "attention_factor": float("nan")}, "attention_factor must be a positive number"),
           ({"factor": 2.0, "truncate": "yes"}, "truncate must be true or false"),
           ({"factor": 2.0, "original_max_position_embeddings": 0}, "original_max_position_embeddings must be")]
    for i, (fields, message) in enumerate(bad):
        with pytest.raises(ValueError, match=message):
            load_model_config(_config_dir(tmp_path / f"bad{i}", {"rope_type": "yarn", **fields}))
    with pytest.raises(ValueError, match=r"unsupported rope type 'mrope'; supported: .*'dynamic'"):
        load_model_config(_config_dir(tmp_path / "long", {"rope_type": "mrope", "factor": 2.0}))
    for i, factor in enumerate((None, 0.5, "2", float("inf"), True)):
        with pytest.raises(ValueError, match="dynamic rope scaling: factor must be a number >= 1"):
            load_model_config(_config_dir(tmp_path / f"dyn{i}", {"rope_type": "dynamic", "factor": factor}))
