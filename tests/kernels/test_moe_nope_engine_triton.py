"""MoE, NoPE and sliding-window models on the Triton backend (CPU interpreter here, compiled on
CUDA) give the torch backend's greedy tokens: the router and grouped-GEMM kernels run, NoPE layers
never launch the rotary kernel, and windows narrower than the sequences are masked by the kernels."""

from __future__ import annotations

import pytest

from pdcluster import LLM, SamplingParams


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("arch", "overrides"), [
    ("qwen2_moe", {"num_hidden_layers": 2, "num_experts": 5, "num_experts_per_tok": 3}),
    ("smollm3", {"num_hidden_layers": 2, "no_rope_layers": [0, 1]}),
    ("mixtral", {"num_hidden_layers": 2, "sliding_window": 5}),  # 9-token prompt, 5 outputs > window
])
def test_triton_backend_equals_torch_backend(tmp_path, arch: str, overrides: dict) -> None:
    from models.tiny_archs import make_checkpoint

    path = make_checkpoint(arch, tmp_path / arch, **overrides)
    prompts = [[5, 9, 31, 7, 100, 3, 3, 8, 15], [44, 12, 9]]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    common = dict(dtype="float32", block_size=4, max_model_len=64, max_num_batched_tokens=8)
    ref = LLM(path, attention_backend="torch", ops_backend="torch", **common).generate(prompts, sp)
    tri = LLM(path, attention_backend="triton", ops_backend="triton", **common).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in tri] == [o.outputs[0].token_ids for o in ref]
