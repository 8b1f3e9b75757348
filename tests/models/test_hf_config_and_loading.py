"""config.json parsing, path resolution and loader errors: every failure names what is wrong."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_checkpoint

from pdcluster.models.hf_config import load_model_config
from pdcluster.models.layers.torch_attention import TorchAttentionBackend
from pdcluster.models.loader import load_model
from pdcluster.models.registry import ARCHITECTURES, get_model_class, resolve_model_path


def write_config(path: pathlib.Path, **fields: object) -> str:
    """A config-only model dir (plus an empty weights file so the weights check passes)."""
    path.mkdir(parents=True, exist_ok=True)
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "max_position_embeddings": 128}
    base.update(fields)
    (path / "config.json").write_text(json.dumps({k: v for k, v in base.items() if v is not None}))
    save_file({}, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("cfg") / "llama")


def test_llama3_checkpoint_config(llama_dir: str) -> None:
    cfg = load_model_config(llama_dir)
    assert (cfg.architecture, cfg.model_type, cfg.dtype) == ("LlamaForCausalLM", "llama", "float32")
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.max_model_len) == (2, 16, 256)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling_dict == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


def test_qwen_flags(tmp_path: pathlib.Path) -> None:
    q2 = load_model_config(write_config(tmp_path / "q2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True,
                                        sliding_window=16, use_sliding_window=False))
    assert q2.attention_bias and not q2.qk_norm and q2.tie_word_embeddings
    assert q2.sliding_window is None and q2.max_model_len == 128  # window inactive without use_sliding_window
    q3 = load_model_config(write_config(tmp_path / "q3", architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert q3.qk_norm and not q3.attention_bias and q3.head_dim == 32


def test_mlp_bias_is_read_where_transformers_reads_it(tmp_path: pathlib.Path) -> None:
    """Llama (and SmolLM3) MLPs take `mlp_bias`; transformers' Qwen2/Mistral/... MLPs never have
    biases whatever config.json says, so neither do ours."""
    assert load_model_config(write_config(tmp_path / "l", mlp_bias=True)).mlp_bias
    assert not load_model_config(write_config(tmp_path / "l0")).mlp_bias
    q2 = load_model_config(write_config(tmp_path / "q2", architectures=["Qwen2ForCausalLM"], mlp_bias=True))
    assert not q2.mlp_bias


def test_legacy_rope_spelling_and_eos_lists(tmp_path: pathlib.Path) -> None:
    path = write_config(tmp_path / "m", rope_theta=1234.0, eos_token_id=[5, 6], torch_dtype="bfloat16",
                        rope_scaling={"type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 7]}))
    cfg = load_model_config(path)
    assert cfg.rope_theta == 1234.0 and cfg.dtype == "bfloat16"
    assert cfg.rope_scaling_dict["rope_type"] == "llama3"
    assert cfg.rope_scaling_dict["original_max_position_embeddings"] == 128
    assert cfg.eos_token_ids == (5, 6, 7)
    assert load_model_config(path, dtype="float32").dtype == "float32"


def test_mistral_sliding_window_does_not_cap_max_model_len(tmp_path: pathlib.Path) -> None:
    # The attention backends mask the window (tests/models/test_sliding_window.py), so sequences
    # may be longer than it.
    path = write_config(tmp_path / "m", architectures=["MistralForCausalLM"], sliding_window=64)
    cfg = load_model_config(path)
    assert (cfg.model_type, cfg.sliding_window, cfg.max_model_len, cfg.layer_windows) == ("mistral", 64, 128, (64,))
    assert load_model_config(path, max_model_len=32).max_model_len == 32


@pytest.mark.parametrize(("fields", "kwargs", "match"), [
    ({"architectures": ["GPT2LMHeadModel"]}, {}, r"GPT2LMHeadModel.*LlamaForCausalLM"),
    ({"rope_parameters": {"rope_type": "mrope", "factor": 4.0}}, {}, r"mrope.*llama3.*yarn.*longrope"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, {}, r"longrope rope scaling: short_factor"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 4.0}}, {}, r"low_freq_factor"),
    ({}, {"dtype": "float8"}, r"dtype"),
    ({}, {"max_model_len": 129}, r"max_model_len"),
    ({"hidden_act": "gelu"}, {}, r"hidden_act"),
    ({"architectures": ["GraniteForCausalLM"], "residual_multiplier": -1}, {},
     r"residual_multiplier must be a positive number, got -1"),
])
def test_config_errors_name_the_problem(tmp_path: pathlib.Path, fields: dict, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_model_config(write_config(tmp_path / "m", **fields), **kwargs)


def test_missing_files_are_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(str(tmp_path))
    path = write_config(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model_config(path)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_path(str(tmp_path / "no-such-model"))


def test_registry() -> None:
    assert set(ARCHITECTURES) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "SmolLM3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                  "Qwen3MoeForCausalLM", "LlavaForConditionalGeneration", "Phi3ForCausalLM",
                                  "GraniteForCausalLM"}
    assert get_model_class("MistralForCausalLM") is ARCHITECTURES["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="FooForCausalLM.*Qwen3ForCausalLM"):
        get_model_class("FooForCausalLM")


def test_missing_tensor_is_named_and_unknown_tensors_ignored(llama_dir: str, tmp_path: pathlib.Path) -> None:
    tensors = load_file(str(pathlib.Path(llama_dir) / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old checkpoints carry it
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((pathlib.Path(llama_dir) / "config.json").read_text())
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(load_model_config(str(broken)), TorchAttentionBackend())


def test_quantized_checkpoints_are_refused_by_name(llama_dir: str, tmp_path: pathlib.Path) -> None:
    """Quantized weights (codes plus scales) read as plain weights would give wrong tokens with an
    OK status: a quantization_config, or a weight stored as float8/int8 without one, is refused."""
    config = json.loads((pathlib.Path(llama_dir) / "config.json").read_text())
    tensors = load_file(str(pathlib.Path(llama_dir) / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    tensors[name.replace(".weight", ".weight_scale_inv")] = torch.ones(1, 1)
    for case, extra in (("fp8", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}),
                        ("ct", {"compression_config": {"format": "float-quantized"}}),
                        ("bare", {})):
        d = tmp_path / case
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"quantization_config \(quant_method='fp8'\) is not supported"):
        load_model_config(str(tmp_path / "fp8"))
    with pytest.raises(ValueError, match=r"compression_config \(quant_method='float-quantized'\)"):
        load_model_config(str(tmp_path / "ct"))
    with pytest.raises(ValueError, match=rf"{name}' is stored as F8_E4M3: quantized weights are not supported"):
        load_model(load_model_config(str(tmp_path / "bare")), TorchAttentionBackend())


def test_missing_lm_head_is_tied_from_embeddings(llama_dir: str, tmp_path: pathlib.Path) -> None:
    tensors = load_file(str(pathlib.Path(llama_dir) / "model.safetensors"))
    del tensors["lm_head.weight"]
    out = tmp_path / "nohead"
    out.mkdir()
    (out / "config.json").write_text((pathlib.Path(llama_dir) / "config.json").read_text())
    save_file(tensors, str(out / "model.safetensors"))
    model = load_model(load_model_config(str(out)), TorchAttentionBackend())
    torch.testing.assert_close(model.lm_head.weight, tensors["model.embed_tokens.weight"])
