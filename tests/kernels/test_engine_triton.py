"""The whole engine on the Triton backend (CPU interpreter here, compiled on CUDA) gives the same
greedy tokens as the torch backend."""

from __future__ import annotations

import pytest
import torch

from pdcluster import LLM, SamplingParams


@pytest.mark.timeout(900)
def test_triton_backend_engine_equals_torch_backend(tmp_path) -> None:
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path / "llama", dtype=torch.float32)
    prompts = [[5, 9, 31, 7, 100, 3, 3, 8, 15, 2, 60], [44, 12, 9]]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(dtype="float32", block_size=4, max_model_len=64, max_num_batched_tokens=8)
    ref = LLM(path, attention_backend="torch", ops_backend="torch", **common).generate(prompts, sp)
    # max_num_batched_tokens=8 splits the 11-token prompt: prefill, chunked prefill with a cached
    # prefix, and decode all run through the Triton kernels.
    tri = LLM(path, attention_backend="triton", ops_backend="triton", **common).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in tri] == [o.outputs[0].token_ids for o in ref]
