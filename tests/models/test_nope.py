"""NoPE layers: SmolLM3's no_rope_layers / no_rope_layer_interval and a rotary dimension of 0 are
token-exact vs transformers, and a layer without rope has no rotary module (no kernel sees rot=0)."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
import transformers
from models.test_model_equivalence import engine_config, hf_greedy, make_prompts, run_greedy
from models.tiny_archs import make_checkpoint

from pdcluster.engine.model_runner import ModelRunner
from pdcluster.models.hf_config import load_model_config

PROMPTS = make_prompts(384, lens=(9, 26, 1))


@pytest.mark.parametrize(("overrides", "rope"), [
    ({"num_hidden_layers": 4, "no_rope_layer_interval": 2}, (True, False, True, False)),
    ({"num_hidden_layers": 3, "no_rope_layers": [0, 1, 0], "hidden_size": 48, "num_attention_heads": 3,
      "num_key_value_heads": 1}, (False, True, False)),
    ({"num_hidden_layers": 3, "no_rope_layer_interval": 3, "tie_word_embeddings": False}, (True, True, False)),
], ids=["interval2", "list", "interval3-untied"])
def test_smollm3_matches_transformers(tmp_path: pathlib.Path, overrides: dict, rope: tuple) -> None:
    path = make_checkpoint("smollm3", tmp_path / "smol", **overrides)
    cfg = load_model_config(path)
    assert cfg.architecture == "SmolLM3ForCausalLM" and cfg.layer_use_rope == rope
    runner = ModelRunner(engine_config(path, block_size=5))
    for layer, uses in zip(runner.model.model.layers, rope):
        assert (layer.self_attn.rotary_emb is not None) == uses
    want = hf_greedy(path, PROMPTS, max_tokens=20)
    assert run_greedy(runner, PROMPTS, max_tokens=20) == want
    assert run_greedy(runner, PROMPTS, max_tokens=20, chunk_size=7, stagger=True) == want


def test_interval_default_as_transformers_computes_it(tmp_path: pathlib.Path) -> None:
    # A config.json without no_rope_layers: derived from the interval, as SmolLM3Config does.
    path = make_checkpoint("smollm3", tmp_path / "smol", num_hidden_layers=5, no_rope_layer_interval=4)
    raw = json.loads((tmp_path / "smol" / "config.json").read_text())
    expected = tuple(bool(x) for x in transformers.SmolLM3Config(**raw).no_rope_layers)
    for key in ("no_rope_layers", "layer_types"):
        raw.pop(key, None)
    (tmp_path / "smol" / "config.json").write_text(json.dumps(raw))
    assert load_model_config(path).layer_use_rope == expected == (True, True, True, False, True)


def test_rotary_dim_zero_runs_without_rotary(tmp_path: pathlib.Path) -> None:
    """partial_rotary_factor 0 on a Llama config: no layer rotates. Equal to SmolLM3 with every
    layer NoPE (same weights, transformers' output), which transformers' Llama cannot express."""
    nope = make_checkpoint("smollm3", tmp_path / "nope", num_hidden_layers=2, no_rope_layers=[0, 0])
    want = hf_greedy(nope, PROMPTS, max_tokens=12)
    llama = tmp_path / "llama"
    shutil.copytree(nope, llama)
    raw = json.loads((llama / "config.json").read_text())
    raw.update(architectures=["LlamaForCausalLM"], model_type="llama",
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.0})
    (llama / "config.json").write_text(json.dumps(raw))
    cfg = load_model_config(str(llama))
    assert cfg.rotary_dim == 0 and not any(cfg.uses_rope(i) for i in range(cfg.num_hidden_layers))
    runner = ModelRunner(engine_config(str(llama), block_size=4))
    assert all(layer.self_attn.rotary_emb is None for layer in runner.model.model.layers)
    with torch.inference_mode():
        assert run_greedy(runner, PROMPTS, max_tokens=12) == want
