"""RMSNorm and fused residual-add + RMSNorm against the torch references."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.norm import (
    fused_add_rms_norm_torch,
    fused_add_rms_norm_triton,
    rms_norm_torch,
    rms_norm_triton,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("num_tokens", [0, 1, 7])
@pytest.mark.parametrize("hidden", [64, 80, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(device, assert_close, dtype, hidden, num_tokens):
    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
    w = torch.randn(hidden, device=device, dtype=dtype)
    out = rms_norm_triton(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, rms_norm_torch(x, w, 1e-6), dtype)


@pytest.mark.parametrize("num_tokens", [0, 1, 7])
@pytest.mark.parametrize("hidden", [64, 80, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(device, assert_close, dtype, hidden, num_tokens):
    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
    res = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
    w = torch.randn(hidden, device=device, dtype=dtype)
    ref_out, ref_res = fused_add_rms_norm_torch(x, res, w, 1e-5)
    x_in, res_in = x.clone(), res.clone()
    out, res_out = fused_add_rms_norm_triton(x_in, res_in, w, 1e-5)
    assert out.data_ptr() == x_in.data_ptr() and res_out.data_ptr() == res_in.data_ptr()  # in place
    assert_close(res_out, ref_res, dtype)
    assert_close(out, ref_out, dtype)


def test_strided_rows_and_3d_input(device, assert_close):
    # per-head q norm: rows of a wider tensor, and a (T, H, D) input normalised over D
    wide = torch.randn(5, 3 * 128, device=device, dtype=torch.bfloat16)
    x = wide[:, 128:256]
    w = torch.randn(128, device=device, dtype=torch.bfloat16)
    assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), torch.bfloat16)
    x3 = torch.randn(4, 3, 128, device=device, dtype=torch.float16)
    w3 = w.half()
    assert_close(rms_norm_triton(x3, w3, 1e-6), rms_norm_torch(x3, w3, 1e-6), torch.float16)
    r3 = torch.randn_like(x3)
    out, res = fused_add_rms_norm_triton(x3.clone(), r3.clone(), w3, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_torch(x3, r3, w3, 1e-6)
    assert out.shape == x3.shape
    assert_close(out, ref_out, torch.float16)
    assert_close(res, ref_res, torch.float16)


def test_argument_errors(device):
    x = torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(32, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm_triton(x, torch.ones(2, 32, device=device), torch.ones(64, device=device), 1e-6)
    with pytest.raises(ValueError, match="x.dtype, residual.dtype"):
        fused_add_rms_norm_triton(x, x.half(), torch.ones(64, device=device), 1e-6)
    with pytest.raises(ValueError, match="x must have dtype"):
        rms_norm_triton(x.int(), torch.ones(64, device=device), 1e-6)
