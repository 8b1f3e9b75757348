"""The C decode-attention kernel (kernels/csrc/paged_decode_cpu.c) against the torch reference,
and the builder's refusals: no compiler, a failing build, a cache folder others can write."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from pdcluster.kernels import native, paged_decode_attention_torch, paged_decode_cpu

pytestmark = pytest.mark.skipif(not paged_decode_cpu.available(), reason="no C compiler on this machine")


def _case(b: int, hq: int, hk: int, d: int, bs: int, lens: list[int], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    nb = max(-(-n // bs) for n in lens) + 1
    nblk = b * nb + 3
    k = torch.randn(nblk, bs, hk, d, generator=g).to(dtype)
    v = torch.randn(nblk, bs, hk, d, generator=g).to(dtype)
    tables = torch.randperm(nblk, generator=g)[: b * nb].view(b, nb).to(torch.int32)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# d = 36: no whole 8-wide blocks, so every score takes the one-position loop; the others take
# blocks of 8 positions and that loop for the rest.
# D = 64 and 128 take the V pass that accumulates in registers, a run of up to 6 (64) or 3 (128,
# AVX-512) query heads per sweep: groups of 8 and 7 need several runs.
@pytest.mark.parametrize(("hq", "hk", "d", "bs"), [(12, 4, 64, 16), (8, 8, 32, 4), (6, 1, 16, 8), (4, 2, 128, 1),
                                                   (4, 2, 36, 8), (16, 2, 64, 16), (7, 1, 128, 4)])
@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_matches_reference(dtype: torch.dtype, hq: int, hk: int, d: int, bs: int, window: int | None) -> None:
    lens = [1, 17, 64, 3, 130]  # one token, partial blocks, exact blocks, longer than every window
    q, k, v, tables, seq_lens = _case(len(lens), hq, hk, d, bs, lens, dtype)
    got = paged_decode_cpu.paged_decode_attention_cpu(q, k, v, tables, seq_lens, d ** -0.5, window)
    want = paged_decode_attention_torch(q, k, v, tables, seq_lens, d ** -0.5, sliding_window=window)
    assert got is not None and got.dtype == dtype and got.shape == q.shape
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize(("hq", "hk", "d", "bs"), [(12, 4, 64, 16), (4, 2, 128, 4), (8, 8, 32, 16)])
def test_bf16_cache_with_a_float32_query(exact: bool, hq: int, hk: int, d: int, bs: int) -> None:
    """A bfloat16 cache under a float32 query: a query of bfloat16 values (a bfloat16 model's,
    widened) may take the vdpbf16ps score pass on an AVX512-BF16 build; any other float32 query
    must not (its low bits would be lost), and both match the float32 reference closely."""
    lens = [16, 47, 300, 5]
    q, k, v, tables, seq_lens = _case(len(lens), hq, hk, d, bs, lens, torch.bfloat16, seed=d)
    q = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    if exact:
        q = q.bfloat16().float()
    got = paged_decode_cpu.paged_decode_attention_cpu(q, k, v, tables, seq_lens, d ** -0.5)
    want = paged_decode_attention_torch(q, k.float(), v.float(), tables, seq_lens, d ** -0.5)
    assert got is not None and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [16, 64])
def test_reads_nothing_behind_the_window_and_zero_length_rows(d: int) -> None:
    """Blocks wholly behind a row's window may be freed and hold anything (NaN here): never read.
    A row with seq_len 0 gives zeros, as the reference does."""
    q, k, v, tables, seq_lens = _case(2, 4, 2, d, 4, [40, 0], torch.float32)
    for blk in tables[0, :5].tolist():  # positions 0-19, behind a window of 12 at seq_len 40
        k[blk] = float("nan")
        v[blk] = float("nan")
    got = paged_decode_cpu.paged_decode_attention_cpu(q, k, v, tables, seq_lens, 0.25, 12)
    want = paged_decode_attention_torch(q, k, v, tables, seq_lens, 0.25, sliding_window=12)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_strided_query_and_wider_tables() -> None:
    """q as a strided view (rows of a fused qkv projection) and tables wider than any row needs."""
    qkv = torch.randn(3, 3 * 8 * 32)
    q = qkv[:, : 8 * 32].view(3, 8, 32)
    _, k, v, tables, seq_lens = _case(3, 8, 4, 32, 8, [9, 30, 2], torch.float32)
    wide = torch.cat([tables, torch.zeros(3, 7, dtype=torch.int32)], dim=1)
    got = paged_decode_cpu.paged_decode_attention_cpu(q, k, v, wide, seq_lens, 0.2)
    want = paged_decode_attention_torch(q.contiguous(), k, v, tables, seq_lens, 0.2)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_unsupported_caches_and_bad_shapes() -> None:
    q, k, v, tables, seq_lens = _case(2, 4, 2, 16, 4, [5, 9], torch.float32)
    half = paged_decode_cpu.paged_decode_attention_cpu(q.half(), k.half(), v.half(), tables, seq_lens, 0.25)
    assert half is None  # float16 caches: the caller's torch path runs
    strided = k.transpose(1, 2)
    assert paged_decode_cpu.paged_decode_attention_cpu(q, strided, strided, tables, seq_lens, 0.25) is None
    with pytest.raises(ValueError, match="needs more than"):
        paged_decode_cpu.paged_decode_attention_cpu(q, k, v, tables, seq_lens * 100, 0.25)
    with pytest.raises(ValueError, match="do not agree"):
        paged_decode_cpu.paged_decode_attention_cpu(q[:1], k, v, tables, seq_lens, 0.25)


@pytest.fixture
def fresh_builder(monkeypatch, tmp_path):
    """native.load with an empty cache of loaded libraries and its own PDCLUSTER_HOME."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("PDCLUSTER_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "native"


def test_built_once_into_a_private_folder_and_reused(fresh_builder) -> None:
    assert native.load("paged_decode_cpu") is not None
    (lib,) = fresh_builder.glob("paged_decode_cpu-*.so")
    assert oct(fresh_builder.stat().st_mode & 0o777) == "0o700"
    assert not lib.stat().st_mode & 0o077
    mtime = lib.stat().st_mtime_ns
    native._loaded.clear()
    assert native.load("paged_decode_cpu") is not None
    assert lib.stat().st_mtime_ns == mtime and list(fresh_builder.glob("*")) == [lib]  # no rebuild, no temp left


def test_no_compiler_or_a_failing_build_falls_back(fresh_builder, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CC", "pdcluster-no-such-compiler")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.load("paged_decode_cpu") is None
    assert "no C compiler" in caplog.text
    native._loaded.clear()
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert native.load("paged_decode_cpu") is None
    assert not list(fresh_builder.glob("*.so"))
    native._loaded.clear()
    monkeypatch.setenv("PDCLUSTER_NATIVE", "0")
    monkeypatch.delenv("CC")
    assert native.load("paged_decode_cpu") is None and not list(fresh_builder.glob("*.so"))


def test_a_folder_others_can_write_is_refused(fresh_builder, caplog) -> None:
    fresh_builder.mkdir(parents=True)
    os.chmod(fresh_builder, 0o777)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.load("paged_decode_cpu") is None
    assert "writable by group or others" in caplog.text
    assert not list(fresh_builder.glob("*.so"))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("b", "hq", "hk"), [(1, 8, 8), (1, 6, 3), (2, 10, 5), (7, 4, 4)])
def test_head_chunks_cover_every_head(threads: int, b: int, hq: int, hk: int) -> None:
    """Few requests split their KV heads into chunks (one task each): every head, once."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lens = [33 + 7 * i for i in range(b)]
        q, k, v, tables, seq_lens = _case(b, hq, hk, 16, 4, lens, torch.float32, seed=b)
        got = paged_decode_cpu.paged_decode_attention_cpu(q, k, v, tables, seq_lens, 0.25)
    finally:
        torch.set_num_threads(before)
    want = paged_decode_attention_torch(q, k, v, tables, seq_lens, 0.25)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
