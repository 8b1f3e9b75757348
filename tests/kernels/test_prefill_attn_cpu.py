"""The C prefill-attention kernel (kernels/csrc/prefill_attn_cpu.c) against a dense float32
reference: several chunks in one call, fresh and over a cached prefix, grouped-query heads,
sliding windows that start inside a tile of keys, prompts spanning many tiles (the online softmax
across tiles), strided queries, one thread and two; and what it refuses."""

from __future__ import annotations

import pytest
import torch
from attention_reference import dense_causal

from pdcluster.kernels import prefill_attn_cpu

pytestmark = pytest.mark.skipif(not prefill_attn_cpu.supports(torch.empty(1, 1, 16), torch.empty(1, 1, 1, 16),
                                                               torch.empty(1, 1, 1, 16)),
                                reason="no C compiler on this machine")

DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not prefill_attn_cpu.has_bf16(), reason="this CPU or build has no AVX512-BF16 dot products"))]


def _case(chunks: list[tuple[int, int]], hq: int, hk: int, d: int, bs: int, dtype: torch.dtype, seed: int = 0,
          q_pad: int = 0):
    """chunks: (context_len, query_len) each. Returns q (a strided view when q_pad), caches whose
    unused slots hold NaN (never read), tables, the kernel's chunk rows, and each chunk's full K/V."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for c, n in chunks]
    nblk = sum(need) + 3
    k_cache = torch.full((nblk, bs, hk, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(nblk, generator=g).tolist()
    width = max(need) + 1
    tables, rows, full, start = [], [], [], 0
    for (c, n), nb in zip(chunks, need):
        blocks = [perm.pop() for _ in range(nb)]
        tables.append(blocks + [0] * (width - nb))
        fk = torch.randn(c + n, hk, d, generator=g).to(dtype)
        fv = torch.randn(c + n, hk, d, generator=g).to(dtype)
        for p in range(c + n):
            k_cache[blocks[p // bs], p % bs] = fk[p]
            v_cache[blocks[p // bs], p % bs] = fv[p]
        full.append((fk, fv))
        rows.append([start, n, c])
        start += n
    wide = torch.randn(start, hq * d + q_pad, generator=g).to(dtype)
    q = wide[:, :hq * d].view(start, hq, d)
    return (q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(rows, dtype=torch.int64),
            full)


def _attend(q, kc, vc, tables, rows, scale, window=None, out=None):
    """The kernel over these chunks (checked for q's rows and the cache's block size)."""
    chunks = prefill_attn_cpu.Chunks.build(tables, rows, q.shape[0], kc.shape[1])
    return prefill_attn_cpu.prefill_attention_cpu(q, kc, vc, chunks, scale, window, out=out)


def _check(q, out, rows, full, scale, window, dtype) -> None:
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    # bfloat16: P is rounded to bf16 before its product with V, as torch's flash kernel does
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for (s, n, c), (fk, fv) in zip(rows.tolist(), full):
        want = dense_causal(q[s:s + n], fk, fv, c, scale, window)
        torch.testing.assert_close(out[s:s + n].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hk", "d", "bs"), [(12, 4, 64, 16), (8, 8, 32, 4), (6, 1, 16, 8), (4, 2, 128, 1),
                                                   (10, 2, 80, 16), (2, 1, 256, 32)])
@pytest.mark.parametrize("window", [None, 1, 7, 70])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_reference(dtype: torch.dtype, hq: int, hk: int, d: int, bs: int, window: int | None,
                           threads: int) -> None:
    # fresh prompts of 1-200 tokens (200 spans four tiles of 64 keys), chunks over a prefix, a
    # zero-length chunk; the q rows are a strided view (a fused QKV projection's q columns)
    chunks = [(0, 200), (0, 5), (37, 29), (130, 1), (0, 0), (64, 64), (3, 90)]
    q, kc, vc, tables, rows, full = _case(chunks, hq, hk, d, bs, dtype, q_pad=2 * hk * d)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _attend(q, kc, vc, tables, rows, d ** -0.5, window)
    finally:
        torch.set_num_threads(prev)
    assert out is not None
    _check(q, out, rows, full, d ** -0.5, window, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_scores_and_rows_outside_the_chunks(dtype: torch.dtype) -> None:
    """Peaked softmax (scale 4: scores in the tens, where a running maximum that moves between
    tiles must rescale the sums), and q rows no chunk names stay as `out` had them."""
    q, kc, vc, tables, rows, full = _case([(0, 150), (20, 70)], 6, 2, 64, 16, dtype, seed=5)
    out = torch.full(q.shape, 3.0, dtype=dtype)
    part = rows[1:]  # the second chunk only
    got = _attend(q, kc, vc, tables[1:].contiguous(), part, 4.0, None, out=out)
    assert got is out
    assert torch.equal(out[:150], torch.full_like(out[:150], 3.0))
    _check(q, out, part, full[1:], 4.0, None, dtype)


def test_refusals() -> None:
    q, kc, vc, tables, rows, _ = _case([(0, 10)], 4, 2, 16, 4, torch.float32)
    # dtypes it does not take (a float16 cache, q and cache disagreeing), a head_dim not a multiple of 16
    assert _attend(q.half(), kc.half(), vc.half(), tables, rows, 0.25) is None
    assert _attend(q.bfloat16(), kc, vc, tables, rows, 0.25) is None
    q2, kc2, vc2, t2, r2, _ = _case([(0, 10)], 4, 2, 24, 4, torch.float32)
    assert _attend(q2, kc2, vc2, t2, r2, 0.25) is None
    # chunks that would read past q or past their table are refused by name, not read
    with pytest.raises(ValueError, match="do not fit"):
        _attend(q, kc, vc, tables, torch.tensor([[5, 10, 0]]), 0.25)
    with pytest.raises(ValueError, match="do not fit"):
        _attend(q, kc, vc, tables, torch.tensor([[0, 10, 40]]), 0.25)
    with pytest.raises(ValueError, match="do not agree"):
        _attend(q, kc, vc, tables.long(), rows, 0.25)
    with pytest.raises(ValueError, match="must be a contiguous"):  # the kernel writes out as one block
        _attend(q, kc, vc, tables, rows, 0.25, out=torch.zeros(4, 10, 16).transpose(0, 1))


def test_switched_off_by_env(monkeypatch) -> None:
    q, kc, vc, tables, rows, _ = _case([(0, 10)], 4, 2, 16, 4, torch.float32)
    monkeypatch.setenv(prefill_attn_cpu.ENV, "0")
    assert _attend(q, kc, vc, tables, rows, 0.25) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_chunk_over_its_own_cache_equals_the_whole_prompt_bit_for_bit(dtype: torch.dtype) -> None:
    """Without a window a row meets the same tiles of keys in the same order whichever chunk (and
    work item) it falls in, so prefilling 150 tokens at once or as 70 + 80 over the cache gives the
    same bits: a prefix-cache hit or a chunked prefill does not move the outputs."""
    q, kc, vc, tables, rows, _ = _case([(0, 150)], 12, 4, 64, 16, dtype, seed=9)
    whole = _attend(q, kc, vc, tables, rows, 0.125)
    parts = torch.zeros_like(whole)
    for first, n in ((0, 70), (70, 80)):  # the second chunk sees the first's keys through the cache
        got = _attend(q, kc, vc, tables, torch.tensor([[first, n, first]]), 0.125,
                                                     out=parts)
        assert got is parts
    assert torch.equal(whole, parts)


def test_an_engine_builds_the_kernel_before_its_first_request(tmp_path) -> None:
    """The build (~1 s on a fresh machine) happens while the engine starts, not inside the first
    prefill: a model runner's start has asked for the library before any request ran."""
    from tiny_models import make_tiny_checkpoint

    from pdcluster.engine.llm import LLM

    path = make_tiny_checkpoint("llama", tmp_path / "model")
    prefill_attn_cpu._fn.cache_clear()
    llm = LLM(path, enforce_eager=True, max_model_len=64)
    try:
        assert prefill_attn_cpu._fn.cache_info().currsize == 1  # asked for once, at start
    finally:
        llm.shutdown()
