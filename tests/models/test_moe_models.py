"""MoE architectures (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE) are token-exact vs
transformers on tiny random checkpoints: several expert counts, top-k, renormalisations and
dense/sparse layer patterns (decoder_sparse_step, mlp_only_layers)."""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers
from models.test_model_equivalence import engine_config, hf_greedy, make_prompts, run_greedy
from models.tiny_archs import make_checkpoint
from safetensors.torch import load_file, save_file

from pdcluster.engine.model_runner import ModelRunner
from pdcluster.models.hf_config import load_model_config
from pdcluster.models.layers.torch_attention import TorchAttentionBackend
from pdcluster.models.loader import load_model
from pdcluster.models.moe_block import SparseMoeBlock

PROMPTS = make_prompts(384, lens=(8, 23, 1, 30))

CASES = {
    "qwen3-e8k2": ("qwen3_moe", {}),
    "qwen3-e5k3-norm-step2": ("qwen3_moe", {"num_experts": 5, "num_experts_per_tok": 3, "norm_topk_prob": True,
                                            "decoder_sparse_step": 2, "num_hidden_layers": 3}),
    "mixtral-e4k2": ("mixtral", {}),
    "mixtral-e6k1": ("mixtral", {"num_local_experts": 6, "num_experts_per_tok": 1, "intermediate_size": 40}),
    "qwen2-e6k2-shared": ("qwen2_moe", {}),
    "qwen2-e7k4-norm-mlponly": ("qwen2_moe", {"num_experts": 7, "num_experts_per_tok": 4, "norm_topk_prob": True,
                                              "mlp_only_layers": [1], "num_hidden_layers": 3, "hidden_size": 48,
                                              "num_attention_heads": 6, "num_key_value_heads": 3}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {case: make_checkpoint(arch, root / case, **kw) for case, (arch, kw) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_greedy_matches_transformers(case: str, checkpoints: dict[str, str]) -> None:
    path = checkpoints[case]
    cfg = load_model_config(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    # Which layers are sparse: exactly transformers' choice.
    hf_sparse = tuple("Sparse" in type(layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe).__name__
                      for layer in hf.model.layers)
    assert cfg.layer_moe == hf_sparse and any(hf_sparse)
    runner = ModelRunner(engine_config(path, block_size=5))
    ours = tuple(isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.model.layers)
    assert ours == hf_sparse
    want = hf_greedy(path, PROMPTS, max_tokens=24)
    assert run_greedy(runner, PROMPTS, max_tokens=24) == want
    assert run_greedy(runner, PROMPTS, max_tokens=24, chunk_size=9, stagger=True, seed=2) == want


def test_moe_prefill_logits_match(checkpoints: dict[str, str]) -> None:
    path = checkpoints["qwen2-e6k2-shared"]
    model = load_model(load_model_config(path), TorchAttentionBackend())
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    layer = model.model.layers[0].mlp
    hf_layer = hf.model.layers[0].mlp
    x = torch.randn(13, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), hf_layer(x[None])[0], atol=1e-5, rtol=1e-5)


def test_stacked_expert_weights(checkpoints: dict[str, str]) -> None:
    path = checkpoints["mixtral-e6k1"]
    model = load_model(load_model_config(path), TorchAttentionBackend())
    tensors = load_file(str(pathlib.Path(path) / "model.safetensors"))
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_weight.shape == (6, 2 * 40, 64) and experts.w2_weight.shape == (6, 64, 40)
    prefix = "model.layers.1.block_sparse_moe.experts.4"
    torch.testing.assert_close(experts.w13_weight[4], torch.cat([tensors[f"{prefix}.w1.weight"],
                                                                 tensors[f"{prefix}.w3.weight"]]))
    torch.testing.assert_close(experts.w2_weight[4], tensors[f"{prefix}.w2.weight"])


def test_missing_expert_tensor_is_named(checkpoints: dict[str, str], tmp_path: pathlib.Path) -> None:
    src = pathlib.Path(checkpoints["qwen3-e8k2"])
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(load_model_config(str(tmp_path)), TorchAttentionBackend())


def test_tp_sharded_experts_equal_tp1(checkpoints: dict[str, str]) -> None:
    """Two ranks' expert shards (each half of every expert's intermediate dim) sum to TP=1's output."""
    path = checkpoints["qwen2-e6k2-shared"]
    cfg = load_model_config(path)
    full = load_model(cfg, TorchAttentionBackend()).model.layers[0].mlp
    ranks = [load_model(cfg, TorchAttentionBackend(), tp_rank=r, tp_size=2).model.layers[0].mlp for r in (0, 1)]

    class SumOfRanks:  # stands in for the all-reduce: collects each rank's partial sums in turn
        def __init__(self) -> None:
            self.parts: list[torch.Tensor] = []

        def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
            self.parts.append(t.clone())
            return t

    x = torch.randn(11, 64)
    outs = []
    for rank in ranks:
        hooks = [SumOfRanks(), SumOfRanks()]
        rank.experts.tp_group, rank.shared_expert.down_proj.tp_group = hooks
        with torch.no_grad():
            weights, ids = rank._ops.moe_router(rank.gate(x), rank.top_k, "softmax", rank.renormalize)
            experts = rank.experts(x, weights.to(x.dtype), ids)
            shared = rank.shared_expert.down_proj(rank.shared_expert.act_fn(rank.shared_expert.gate_up_proj(x)))
        outs.append((experts, shared))
    with torch.no_grad():
        expected = full(x)
        gate = torch.sigmoid(full.shared_expert_gate(x))
    got = outs[0][0] + outs[1][0] + gate * (outs[0][1] + outs[1][1])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_tp_size_must_divide_the_expert_size(tmp_path: pathlib.Path) -> None:
    from pdcluster.config import EngineArgs

    path = make_checkpoint("qwen3_moe", tmp_path / "odd", moe_intermediate_size=25)
    with pytest.raises(ValueError, match="moe_intermediate_size=25"):
        EngineArgs(model=path, tensor_parallel_size=2, device="cpu").create_engine_config()
