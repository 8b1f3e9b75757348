"""Layer-level checks: the torch attention backend against a naive reference, TP weight loaders."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pdcluster.models.layers.attention_backend import AttentionMetadata
from pdcluster.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdcluster.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pdcluster.models.layers.torch_attention import TorchAttentionBackend


def build_meta(context_lens: list[int], query_lens: list[int], block_size: int, num_blocks: int,
               seed: int = 0) -> AttentionMetadata:
    """Random, non-contiguous block tables for requests with the given cached/new token counts."""
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    tables, slots = [], []
    for c, s in zip(context_lens, seq_lens):
        blocks = [free.pop() for _ in range(-(-s // block_size))]
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c, s)]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(len(query_lens), qsl[-1], torch.tensor(qsl, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32),
                             torch.tensor(tables, dtype=torch.int32), torch.tensor(slots, dtype=torch.int64),
                             max(query_lens), max(seq_lens), query_lens, seq_lens, context_lens)


def reference_attention(q, k_all, v_all, context_len, scale):
    """q: (n, Hq, D) at positions context_len.., k_all/v_all: (S, Hk, D), explicit float32 softmax."""
    rep = q.shape[1] // k_all.shape[1]
    k, v = k_all.float().repeat_interleave(rep, 1), v_all.float().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    pos_q = torch.arange(context_len, context_len + q.shape[0])
    scores.masked_fill_(torch.arange(k.shape[0])[None, :] > pos_q[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("context_lens", "query_lens"), [
    ([0, 0, 0], [5, 1, 12]),          # fresh prefills (one of a single token)
    ([7, 0, 13, 3], [1, 9, 4, 1]),    # mixed: decodes, a fresh prefill, a prefill over a cached prefix
    ([4, 11, 0, 22], [1, 1, 1, 1]),   # decode-only batch
])
def test_torch_attention_matches_reference(context_lens, query_lens, dtype) -> None:
    torch.manual_seed(0)
    hq, hk, d, bs, nb = 4, 2, 8, 5, 40
    meta = build_meta(context_lens, query_lens, bs, nb)
    k_cache = torch.zeros(nb, bs, hk, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # Full per-request K/V; the cached prefix is written into the cache up front.
    full_k = [torch.randn(c + q, hk, d, dtype=dtype) for c, q in zip(context_lens, query_lens)]
    full_v = [torch.randn(c + q, hk, d, dtype=dtype) for c, q in zip(context_lens, query_lens)]
    for i, c in enumerate(context_lens):
        for p in range(c):
            blk = int(meta.block_tables[i, p // bs])
            k_cache[blk, p % bs], v_cache[blk, p % bs] = full_k[i][p], full_v[i][p]
    q = torch.randn(sum(query_lens), hq, d, dtype=dtype)
    k = torch.cat([fk[c:] for fk, c in zip(full_k, context_lens)])
    v = torch.cat([fv[c:] for fv, c in zip(full_v, context_lens)])
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, d**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    start = 0
    for i, (c, n) in enumerate(zip(context_lens, query_lens)):
        want = reference_attention(q[start:start + n], full_k[i], full_v[i], c, d**-0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[start:start + n].float(), want, atol=tol, rtol=tol)
        start += n


def test_tensor_parallel_loaders_reassemble_the_full_layer() -> None:
    torch.manual_seed(0)
    hidden, d, hq, hk, inter, tp = 16, 4, 4, 2, 12, 2
    x = torch.randn(3, hidden)
    wq, wk, wv = torch.randn(hq * d, hidden), torch.randn(hk * d, hidden), torch.randn(hk * d, hidden)
    wg, wu, wo = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    q_parts, k_parts, act_parts, partial = [], [], [], torch.zeros(3, hidden)
    for rank in range(tp):
        qkv = QKVParallelLinear(hidden, d, hq, hk, False, torch.float32, rank, tp)
        for w, sid in ((wq, "q"), (wk, "k"), (wv, "v")):
            qkv.weight.weight_loader(qkv.weight, w, sid)
        q, k, _ = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], -1)
        q_parts.append(q)
        k_parts.append(k)
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], False, torch.float32, rank, tp)
        gate_up.weight.weight_loader(gate_up.weight, wg, 0)
        gate_up.weight.weight_loader(gate_up.weight, wu, 1)
        g, u = gate_up(x).chunk(2, -1)
        act = F.silu(g) * u
        act_parts.append(act)
        down = RowParallelLinear(inter, hidden, False, torch.float32, rank, tp)
        down.weight.weight_loader(down.weight, wo)
        partial += F.linear(act, down.weight)  # what the all-reduce sums
    torch.testing.assert_close(torch.cat(q_parts, -1), x @ wq.T)
    torch.testing.assert_close(torch.cat(k_parts, -1), x @ wk.T)
    full_act = F.silu(x @ wg.T) * (x @ wu.T)
    torch.testing.assert_close(torch.cat(act_parts, -1), full_act)
    torch.testing.assert_close(partial, full_act @ wo.T, atol=1e-4, rtol=1e-4)


def test_kv_heads_replicate_when_fewer_than_ranks() -> None:
    wk = torch.arange(2 * 4 * 8, dtype=torch.float32).reshape(8, 8)  # 2 KV heads of dim 4
    shards = []
    for rank in range(4):
        qkv = QKVParallelLinear(8, 4, 4, 2, False, torch.float32, rank, 4)
        qkv.weight.weight_loader(qkv.weight, wk, "k")
        shards.append(qkv.weight[qkv.q_size:qkv.q_size + qkv.kv_size])
    # Ranks 0,1 hold KV head 0; ranks 2,3 hold KV head 1.
    assert torch.equal(shards[0], wk[:4]) and torch.equal(shards[1], wk[:4])
    assert torch.equal(shards[2], wk[4:]) and torch.equal(shards[3], wk[4:])


def test_vocab_parallel_shards_pad_the_last_range() -> None:
    w = torch.randn(7, 3)
    parts = []
    for rank in range(2):
        emb = VocabParallelEmbedding(7, 3, torch.float32, rank, 2)
        emb.weight.weight_loader(emb.weight, w)
        parts.append(emb.weight)
    assert torch.equal(torch.cat(parts)[:7], w) and torch.equal(parts[1][-1], torch.zeros(3))
    head = ParallelLMHead(7, 3, torch.float32)
    head.weight.weight_loader(head.weight, w)
    h = torch.randn(2, 3)
    torch.testing.assert_close(head(h), h @ w.T)
