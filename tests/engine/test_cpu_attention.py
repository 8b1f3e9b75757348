"""The CPU-shaped torch attention (pdcluster/models/layers/cpu_attention.py) against an explicit
float32 reference, in every batch composition its step plan distinguishes: runs of equal-length
fresh prefills (one SDPA call per run), prefills over a cached prefix, decodes (alone and mixed),
with and without a sliding window."""

from __future__ import annotations

import pytest
import torch

from pdcluster.models.layers import cpu_attention
from pdcluster.models.layers.attention_backend import AttentionMetadata

HQ, HK, D, BS, NB = 6, 2, 8, 4, 64


def _meta(context_lens: list[int], query_lens: list[int]) -> AttentionMetadata:
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    width = max(-(-s // BS) for s in seq_lens)
    free = torch.randperm(NB, generator=torch.Generator().manual_seed(1)).tolist()
    tables, slots = [], []
    for c, s in zip(context_lens, seq_lens):
        blocks = [free.pop() for _ in range(-(-s // BS))]
        tables.append(blocks + [0] * (width - len(blocks)))
        slots += [blocks[p // BS] * BS + p % BS for p in range(c, s)]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(len(query_lens), qsl[-1], torch.tensor(qsl, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32),
                             torch.tensor(tables, dtype=torch.int32), torch.tensor(slots, dtype=torch.int64),
                             max(query_lens), max(seq_lens), query_lens, seq_lens, context_lens)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, window: int | None):
    """q (n, Hq, D) at positions context_len.., k/v (S, Hk, D): float32 masked softmax."""
    k, v = k.float().repeat_interleave(HQ // HK, 1), v.float().repeat_interleave(HQ // HK, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * D**-0.5
    qpos, kpos = torch.arange(context_len, context_len + q.shape[0])[:, None], torch.arange(k.shape[0])[None, :]
    hidden = kpos > qpos
    if window is not None:
        hidden |= kpos <= qpos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize(("context_lens", "query_lens"), [
    ([0, 0, 0, 0], [5, 5, 5, 7]),          # a run of three equal fresh prefills, then another length
    ([0, 0, 9, 0, 0], [6, 6, 4, 6, 6]),    # a prefill over a cached prefix breaks the run in two
    ([7, 0, 13, 3, 0], [1, 9, 4, 1, 9]),   # decodes mixed with fresh and cached prefills
    ([4, 11, 0, 22], [1, 1, 1, 1]),        # decode only (a one-token fresh prefill among them)
])
def test_matches_reference(context_lens: list[int], query_lens: list[int], window: int | None,
                           dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    meta = _meta(context_lens, query_lens)
    k_cache = torch.zeros(NB, BS, HK, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    full_k = [torch.randn(c + n, HK, D, dtype=dtype) for c, n in zip(context_lens, query_lens)]
    full_v = [torch.randn(c + n, HK, D, dtype=dtype) for c, n in zip(context_lens, query_lens)]
    q = torch.randn(sum(query_lens), HQ, D, dtype=dtype)
    k = torch.cat([fk[c:] for fk, c in zip(full_k, context_lens)])
    v = torch.cat([fv[c:] for fv, c in zip(full_v, context_lens)])
    # Everything (prefix and new tokens) in the cache, as the backend's cache write leaves it.
    for i, c in enumerate(context_lens):
        for p in range(c + query_lens[i]):
            blk = int(meta.block_tables[i, p // BS])
            k_cache[blk, p % BS], v_cache[blk, p % BS] = full_k[i][p], full_v[i][p]
    plan = cpu_attention.build_plan(meta, BS)
    out = cpu_attention.attention(q, k, v, k_cache, v_cache, meta, plan, D**-0.5, window)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    start = 0
    for i, (c, n) in enumerate(zip(context_lens, query_lens)):
        want = _reference(q[start:start + n], full_k[i], full_v[i], c, window)
        torch.testing.assert_close(out[start:start + n].float(), want, atol=tol, rtol=tol)
        start += n


def test_plan_groups_equal_fresh_prefills_and_is_reused_per_step() -> None:
    meta = _meta([0, 0, 9, 0, 0, 5], [6, 6, 4, 6, 6, 1])
    plan = cpu_attention.build_plan(meta, BS)
    assert plan.fresh_runs == [(0, 2, 6), (16, 2, 6)]  # (first token, requests, length)
    assert plan.prefills == [(2, 12, 9)]
    assert plan.decode is not None and plan.decode.num_reqs == 1 and plan.decode.tokens.tolist() == [28]
    cache = cpu_attention.PlanCache()
    assert cache.get(meta, BS) is cache.get(meta, BS)  # every layer of the step shares one plan
    assert cache.get(_meta([0], [3]), BS) is not cache.get(meta, BS)
