"""SiLU-and-mul against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.activation import silu_and_mul_torch, silu_and_mul_triton


@pytest.mark.parametrize("num_tokens", [0, 1, 6])
@pytest.mark.parametrize("inter", [1, 300, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul(device, assert_close, dtype, inter, num_tokens):
    x = torch.randn(num_tokens, 2 * inter, device=device, dtype=dtype) * 3
    out = silu_and_mul_triton(x)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    assert_close(out, silu_and_mul_torch(x), dtype)


def test_strided_rows_and_3d(device, assert_close):
    wide = torch.randn(4, 1000, device=device, dtype=torch.bfloat16)
    x = wide[:, :600]  # row stride 1000
    assert_close(silu_and_mul_triton(x), silu_and_mul_torch(x), torch.bfloat16)
    x3 = torch.randn(2, 3, 64, device=device, dtype=torch.float16)
    assert_close(silu_and_mul_triton(x3), silu_and_mul_torch(x3), torch.float16)


def test_argument_errors(device):
    with pytest.raises(ValueError, match="last dimension must be even"):
        silu_and_mul_triton(torch.randn(2, 7, device=device))
    with pytest.raises(ValueError, match="x must have dtype"):
        silu_and_mul_triton(torch.ones(2, 8, dtype=torch.int32, device=device))
