"""CPU paged attention (cpu_attention.py + cpu_decode.py) in mixed steps against a per-request
dense causal reference in float32: fresh prefills of unequal lengths, chunks over a cached prefix,
decodes of very different context lengths (cut into several length groups), with and without a
sliding window, few KV heads (block-diagonal products) and many (head-major products). Blocks
behind every window and blocks no table names hold NaN: they must never be read."""

from __future__ import annotations

import random

import pytest
import torch
from attention_reference import dense_causal

from pdcluster.kernels import paged_decode_cpu, prefill_attn_cpu
from pdcluster.models.layers import cpu_attention, cpu_decode
from pdcluster.models.layers.attention_backend import AttentionMetadata

D, BS, NB = 16, 4, 256


def _setup(context_lens: list[int], query_lens: list[int], hk: int, hq: int, dtype: torch.dtype,
           window: int | None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    width = max(-(-s // BS) for s in seq_lens) + 2  # trailing 0 entries, as the runner pads
    free = torch.randperm(NB, generator=gen).tolist()
    k_cache = torch.full((NB, BS, hk, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, slots, full_k, full_v = [], [], [], []
    for c, s in zip(context_lens, seq_lens):
        blocks = [free.pop() for _ in range(-(-s // BS))]
        tables.append(blocks + [0] * (width - len(blocks)))
        slots += [blocks[p // BS] * BS + p % BS for p in range(c, s)]
        fk = torch.randn(s, hk, D, generator=gen).to(dtype)
        fv = torch.randn(s, hk, D, generator=gen).to(dtype)
        full_k.append(fk)
        full_v.append(fv)
        # The last query of this request reads from position s - window on (a fresh prefill's
        # earliest query reads from 0; a chunk's first query from c - window + 1).
        first_read = 0 if window is None else max(0, min(c, s - 1) - window + 1)
        for p in range(s):
            blk = blocks[p // BS]
            if p // BS >= first_read // BS:  # blocks wholly behind every query's window: NaN (freed)
                k_cache[blk, p % BS], v_cache[blk, p % BS] = fk[p], fv[p]
        for p in range(s, len(blocks) * BS):  # the tail of the last block: finite stale values
            k_cache[blocks[-1], p % BS] = v_cache[blocks[-1], p % BS] = 7.0
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(len(query_lens), qsl[-1], torch.tensor(qsl, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32),
                             torch.tensor(tables, dtype=torch.int32), torch.tensor(slots, dtype=torch.int64),
                             max(query_lens), max(seq_lens), query_lens, seq_lens, context_lens)
    q = torch.randn(qsl[-1], hq, D, generator=gen).to(dtype)
    k = torch.cat([fk[c:] for fk, c in zip(full_k, context_lens)])
    v = torch.cat([fv[c:] for fv, c in zip(full_v, context_lens)])
    return meta, q, k, v, k_cache, v_cache, full_k, full_v


def _mixed(rng: random.Random) -> tuple[list[int], list[int]]:
    """Fresh prefills of unequal (and some equal) lengths, chunks over a prefix, decodes of 1-90 tokens."""
    ctx, ql = [], []
    for _ in range(14):
        ctx.append(rng.choice([1, 2, 3, 5, 9, 17, 30, 47, 63, 88]))
        ql.append(1)
    for n in (5, 5, 9, 2, 13):
        ctx.append(0)
        ql.append(n)
    for c, n in ((6, 7), (21, 3), (40, 11)):
        ctx.append(c)
        ql.append(n)
    order = list(range(len(ctx)))
    rng.shuffle(order)
    return [ctx[i] for i in order], [ql[i] for i in order]


@pytest.mark.parametrize("overhead", [0, cpu_decode.GROUP_OVERHEAD_KEYS])  # many groups / few
@pytest.mark.parametrize(("hk", "hq"), [(2, 6), (8, 8)])  # block-diagonal / head-major products
@pytest.mark.parametrize("window", [None, 7, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])  # the C kernels / the torch paths
def test_mixed_step_matches_dense_reference(monkeypatch, overhead: int, hk: int, hq: int, window: int | None,
                                            dtype: torch.dtype, decode_only: bool, native: bool) -> None:
    monkeypatch.setattr(cpu_decode, "GROUP_OVERHEAD_KEYS", overhead)
    if native and not paged_decode_cpu.available():
        pytest.skip("no C compiler: the native decode kernel is not built on this machine")
    if native:  # the kernel takes every decode row: the torch products must not run
        monkeypatch.setattr(cpu_decode, "decode", lambda *a: pytest.fail("torch decode path ran"))
    if native and prefill_attn_cpu.supports(torch.empty(1, hq, D, dtype=dtype), torch.empty(1, BS, hk, D, dtype=dtype),
                                            torch.empty(1, BS, hk, D, dtype=dtype)):
        # every prompt chunk goes to the prefill kernel: torch's SDPA paths must not run
        monkeypatch.setattr(cpu_attention, "_fresh", lambda *a: pytest.fail("torch fresh-prefill path ran"))
        monkeypatch.setattr(cpu_attention, "_over_cache", lambda *a: pytest.fail("torch chunk path ran"))
    if not native:
        monkeypatch.setattr(paged_decode_cpu, "supports", lambda *a: False)
        monkeypatch.setattr(prefill_attn_cpu, "supports", lambda *a: False)
    ctx, ql = _mixed(random.Random(3))
    if decode_only:
        ctx, ql = [c for c, n in zip(ctx, ql) if n == 1], [1 for n in ql if n == 1]
    meta, q, k, v, k_cache, v_cache, full_k, full_v = _setup(ctx, ql, hk, hq, dtype, window)
    plan = cpu_attention.build_plan(meta, BS)
    out = cpu_attention.attention(q, k, v, k_cache, v_cache, meta, plan, D**-0.5, window)
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    groups = plan.decode.view(window)
    assert sorted(sum(([] if g.rows is None else g.rows.tolist() for g in groups), [])) == (
        [] if groups[0].rows is None else sorted(plan.decode.tokens_cpu))
    if overhead == 0 and window is None:
        assert len(groups) > 1  # the decode rows really were cut by length
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    start = 0
    for i, (c, n) in enumerate(zip(ctx, ql)):
        want = dense_causal(q[start:start + n], full_k[i], full_v[i], c, D**-0.5, window)
        torch.testing.assert_close(out[start:start + n].float(), want, atol=tol, rtol=tol)
        start += n


def test_group_rows_cuts_by_length_and_covers_every_row() -> None:
    count = [1, 40, 2, 41, 1, 3, 40, 2]
    groups = cpu_decode.group_rows(count, overhead=4)
    assert sorted(sum(groups, [])) == list(range(len(count)))
    assert [sorted(count[i] for i in g) for g in groups] == [[1, 1, 2, 2, 3], [40, 40, 41]]
    assert cpu_decode.group_rows(count, overhead=10_000) == [sorted(range(8), key=count.__getitem__)]
    assert len(cpu_decode.group_rows(count, overhead=0)) == 5  # one group per distinct count
    many = list(range(1, 500))  # more distinct counts than the programme considers: rounded first
    groups = cpu_decode.group_rows(many, overhead=50)
    assert sorted(sum(groups, [])) == list(range(len(many)))
    assert 1 < len(groups) < 64


def test_one_group_keeps_the_step_order() -> None:
    meta, *_ = _setup([5, 3, 9], [1, 1, 1], 2, 6, torch.float32, None)
    groups = cpu_attention.build_plan(meta, BS).decode.view(None)
    assert len(groups) == 1 and groups[0].rows is None and groups[0].num_blocks == 3
