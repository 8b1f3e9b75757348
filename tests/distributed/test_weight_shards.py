"""Each rank reads only its shard of the checkpoint (lazy safetensors slices), and the shards of
all ranks put back together are exactly the TP=1 model."""

from __future__ import annotations

import math

import pytest
import torch

from pdcluster.models import loader as loader_mod
from pdcluster.models.layers.torch_attention import TorchAttentionBackend


class CountingSlice:
    """Wraps a safetensors slice and counts the elements actually read through it."""

    def __init__(self, inner, counter: dict[str, int], name: str) -> None:
        self.inner, self.counter, self.name = inner, counter, name

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, index):
        out = self.inner[index]
        self.counter[self.name] = self.counter.get(self.name, 0) + out.numel()
        return out


def load_counting(monkeypatch, path: str, rank: int, tp: int):
    from pdcluster.config import EngineArgs

    real = loader_mod.iter_checkpoint_slices
    read: dict[str, int] = {}
    total: dict[str, int] = {}

    def counting(p):
        for name, sl in real(p):
            total[name] = math.prod(sl.get_shape())
            yield name, CountingSlice(sl, read, name)

    monkeypatch.setattr(loader_mod, "iter_checkpoint_slices", counting)
    cfg = EngineArgs(model=path, num_kv_blocks=16, tensor_parallel_size=tp).create_engine_config().model
    model = loader_mod.load_model(cfg, TorchAttentionBackend(), tp_rank=rank, tp_size=tp)
    return model, read, total


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen3", {"num_key_value_heads": 1})])
def test_rank_reads_only_its_shard(monkeypatch, tiny_ckpt, arch: str, overrides: dict) -> None:
    path = tiny_ckpt(arch, **overrides)
    _, read, total = load_counting(monkeypatch, path, rank=1, tp=2)
    for name, n in total.items():
        replicated = "norm" in name or (overrides and name.endswith(("k_proj.weight", "v_proj.weight")))
        assert read[name] == (n if replicated else n // 2), name
    assert sum(read.values()) < 0.6 * sum(total.values())


def test_shards_reassemble_the_full_model(monkeypatch, tiny_ckpt) -> None:
    path = tiny_ckpt("qwen3", num_key_value_heads=1)
    full, _, _ = load_counting(monkeypatch, path, rank=0, tp=1)
    parts = [load_counting(monkeypatch, path, rank=r, tp=2)[0] for r in range(2)]
    f, p0, p1 = (m.model.layers[0] for m in (full, *parts))
    # Row parallel: input columns split; column parallel (gate_up): each projection's rows split.
    torch.testing.assert_close(torch.cat([p0.mlp.down_proj.weight, p1.mlp.down_proj.weight], 1),
                               f.mlp.down_proj.weight, rtol=0, atol=0)
    inter = f.mlp.gate_up_proj.weight.shape[0] // 2
    gate = torch.cat([p.mlp.gate_up_proj.weight[: inter // 2] for p in (p0, p1)])
    torch.testing.assert_close(gate, f.mlp.gate_up_proj.weight[:inter], rtol=0, atol=0)
    # One KV head, two ranks: both hold it (replicated), each holds half of the q heads.
    q = f.self_attn.qkv_proj.q_size
    for p in (p0, p1):
        torch.testing.assert_close(p.self_attn.qkv_proj.weight[q // 2:], f.self_attn.qkv_proj.weight[q:],
                                   rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([p.self_attn.qkv_proj.weight[: q // 2] for p in (p0, p1)]),
                               f.self_attn.qkv_proj.weight[:q], rtol=0, atol=0)
    emb = torch.cat([m.model.embed_tokens.weight for m in parts])[: full.config.vocab_size]
    torch.testing.assert_close(emb, full.model.embed_tokens.weight, rtol=0, atol=0)
