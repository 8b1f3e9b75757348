"""The C element-wise kernels (kernels/csrc/elementwise_cpu.c) against the torch references, and
the fall-backs of kernels/elementwise_cpu.py where the kernel does not apply."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels import elementwise_cpu as ew
from pdcluster.kernels.activation import silu_and_mul_torch
from pdcluster.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from pdcluster.kernels.ops import get_ops
from pdcluster.kernels.rotary import rotary_embedding_torch

pytestmark = pytest.mark.skipif(not ew.available(), reason="no C compiler on this machine")
TOL = dict(atol=2e-6, rtol=2e-6)  # float32: the mean's summation order and FMA contraction only


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("rows", [0, 1, 5, 300])  # 300 x 768: over PARALLEL_MIN, rows split over threads
@pytest.mark.parametrize("hidden", [1, 7, 64, 768])
def test_rms_norm_and_fused_add(rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * 7 + hidden)
    wide = torch.randn(rows, hidden + 3, generator=g) * 3
    x = wide[:, :hidden]  # a row stride wider than the row
    res = torch.randn(rows, hidden, generator=g)
    w = torch.randn(hidden, generator=g)
    _close(ew.rms_norm_cpu(x, w, 1e-5), rms_norm_torch(x, w, 1e-5))
    out, res_out = ew.fused_add_rms_norm_cpu(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_torch(x, res, w, 1e-6)
    _close(out, ref_out)
    assert torch.equal(res_out, ref_res)  # one float32 add: exact


def _cache(max_pos: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    f = torch.arange(max_pos).float()[:, None] * inv[None, :]
    return torch.cat((f.cos(), f.sin()), dim=-1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("head_dim", "rot"), [(64, 64), (80, 40), (128, 64), (32, 2)])
@pytest.mark.parametrize("tokens", [1, 6, 700])  # 700 tokens: the parallel branch
def test_rotary_in_place_on_views_of_a_fused_projection(is_neox: bool, head_dim: int, rot: int, tokens: int) -> None:
    hq, hk = 4, 2
    g = torch.Generator().manual_seed(head_dim + rot + tokens)
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=g)
    v_before = qkv[:, (hq + hk) * head_dim:].clone()
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim: (hq + hk) * head_dim].view(tokens, hk, head_dim)
    positions = torch.randint(0, 1000, (tokens,), generator=g)
    cache = _cache(1000, rot)
    q_ref, k_ref = rotary_embedding_torch(positions, q.clone(), k.clone(), cache, is_neox)
    q_out, k_out = ew.rotary_embedding_cpu(positions, q, k, cache, is_neox)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
    _close(q, q_ref)
    _close(k, k_ref)
    assert torch.equal(qkv[:, (hq + hk) * head_dim:], v_before)  # neighbours untouched


def test_rotary_q_and_k_as_one_tensor_and_int32_positions() -> None:
    """The attention layer rotates q and k side by side as one (T, Hq + Hk, D) view, k empty."""
    qk = torch.randn(3, 6, 64)
    pos = torch.tensor([0, 9, 4], dtype=torch.int32)
    want, _ = rotary_embedding_torch(pos, qk.clone(), qk[:, :0].clone(), _cache(10, 64))
    ew.rotary_embedding_cpu(pos, qk, qk[:, :0], _cache(10, 64))
    _close(qk, want)


def test_rotary_position_outside_the_cache_raises_like_the_reference_and_writes_nothing() -> None:
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(IndexError):
        ew.rotary_embedding_cpu(torch.tensor([1, 16]), q, k, _cache(16, 8))
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("rows", [0, 1, 4, 40])  # 40 x 2048: the parallel branch
@pytest.mark.parametrize("inter", [1, 13, 2048])
def test_silu_and_mul(rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(rows + inter)
    x = torch.randn(rows, 2 * inter, generator=g) * 8  # gates far into both tails of the sigmoid
    if rows and inter > 1:
        x[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    _close(ew.silu_and_mul_cpu(x), silu_and_mul_torch(x))


def _bf16_like_the_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16 results: the kernel rounds where the reference's bf16 ops round, so they differ
    only where a last-bit float32 difference (sum order, FMA, exp) crosses a rounding boundary:
    at most one bfloat16 step, and rarely. (Rounding once where the reference rounds twice moves
    ~10-25% of the values: the rate below catches it.)"""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    g, w = got.float(), want.float()
    step = torch.where(w == 0, torch.full_like(w, 2.0 ** -133), w.abs() * 2.0 ** -7)  # >= one bf16 ulp
    assert bool(((g - w).abs() <= step).all())
    assert (g != w).float().mean().item() <= 0.01


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_bfloat16_rows_round_as_the_reference_does(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    h = 768
    x = (torch.randn(rows, h, generator=g) * 3).bfloat16()
    res = torch.randn(rows, h, generator=g).bfloat16()
    w = (1 + 0.5 * torch.randn(h, generator=g)).bfloat16()
    _bf16_like_the_reference(ew.rms_norm_cpu(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))
    out, res_out = ew.fused_add_rms_norm_cpu(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_torch(x, res, w, 1e-6)
    _bf16_like_the_reference(out, ref_out)
    assert torch.equal(res_out, ref_res)  # one rounded add, as bf16 + bf16 rounds it
    gu = (torch.randn(rows, 2 * 1024, generator=g) * 4).bfloat16()
    _bf16_like_the_reference(ew.silu_and_mul_cpu(gu), silu_and_mul_torch(gu))
    qk = (torch.randn(rows, 6, 64, generator=g) * 2).bfloat16()
    pos = torch.randint(0, 500, (rows,), generator=g)
    want, _ = rotary_embedding_torch(pos, qk.clone(), qk[:, :0].clone(), _cache(500, 64))
    got = qk.clone()
    ew.rotary_embedding_cpu(pos, got, got[:, :0], _cache(500, 64))
    _bf16_like_the_reference(got, want)


def test_what_the_kernels_do_not_take_runs_the_reference_bit_for_bit() -> None:
    """bfloat16 rows with a float32 weight (the reference promotes), a transposed input, 3-D norm
    input, float16: the reference's own result, exactly."""
    w = torch.randn(16)
    xb = torch.randn(4, 16).bfloat16()
    assert torch.equal(ew.rms_norm_cpu(xb, w, 1e-6), rms_norm_torch(xb, w, 1e-6))
    xt = torch.randn(16, 4).t()  # last dimension strided
    assert torch.equal(ew.rms_norm_cpu(xt, w, 1e-6), rms_norm_torch(xt, w, 1e-6))
    x3 = torch.randn(2, 3, 16)
    assert torch.equal(ew.rms_norm_cpu(x3, w, 1e-6), rms_norm_torch(x3, w, 1e-6))
    gh = torch.randn(3, 8).half()
    assert torch.equal(ew.silu_and_mul_cpu(gh), silu_and_mul_torch(gh))


def test_the_torch_ops_backend_runs_the_c_kernels() -> None:
    ops = get_ops("torch")
    assert ops.rms_norm is ew.rms_norm_cpu and ops.fused_add_rms_norm is ew.fused_add_rms_norm_cpu
    assert ops.silu_and_mul is ew.silu_and_mul_cpu and ops.rotary_embedding is ew.rotary_embedding_cpu


def test_without_the_library_every_op_is_the_reference(monkeypatch) -> None:
    """No compiler / PDCLUSTER_NATIVE=0: the functions are the references, bit for bit."""
    monkeypatch.setattr(ew, "_lib", lambda: None)
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    assert torch.equal(ew.rms_norm_cpu(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))
    for got, want in zip(ew.fused_add_rms_norm_cpu(x, r, w, 1e-6), fused_add_rms_norm_torch(x, r, w, 1e-6)):
        assert torch.equal(got, want)
    g = torch.randn(3, 32)
    assert torch.equal(ew.silu_and_mul_cpu(g), silu_and_mul_torch(g))
    q = torch.randn(3, 2, 8)
    want, _ = rotary_embedding_torch(torch.arange(3), q.clone(), q[:, :0], _cache(4, 8))
    ew.rotary_embedding_cpu(torch.arange(3), q, q[:, :0], _cache(4, 8))
    assert torch.equal(q, want)
