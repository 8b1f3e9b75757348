"""KV cache write (with float8 e4m3 quantisation) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.cache_write import reshape_and_cache_torch, reshape_and_cache_triton

CASES = {  # id: (model dtype, cache dtype, scale kind)
    "f32": (torch.float32, torch.float32, None),
    "bf16": (torch.bfloat16, torch.bfloat16, None),
    "f16": (torch.float16, torch.float16, None),
    "fp8-noscale": (torch.bfloat16, torch.float8_e4m3fn, None),
    "fp8-tensor": (torch.bfloat16, torch.float8_e4m3fn, "tensor"),
    "fp8-head": (torch.float16, torch.float8_e4m3fn, "head"),
}


def _scales(kind, num_heads, device):
    if kind == "tensor":
        return 0.05, torch.tensor([0.07], device=device)  # a float and a 1-element tensor
    if kind == "head":
        return torch.rand(num_heads, device=device) + 0.01, torch.rand(num_heads, device=device) + 0.01
    return None, None


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_cache_write(device, case, block_size, head_dim):
    dtype, cache_dtype, kind = CASES[case]
    num_tokens, num_heads, num_blocks = 7, 3, 9
    # k and v as strided views of one fused (T, 2, H, D) tensor; big values exercise saturation
    kv = torch.randn(num_tokens, 2, num_heads, head_dim, device=device, dtype=dtype) * 40
    k, v = kv[:, 0], kv[:, 1]
    total = num_blocks * block_size
    slots = torch.randperm(total, device=device)[:num_tokens]
    slots[2] = -1  # padding token: skipped
    k_scale, v_scale = _scales(kind, num_heads, device)
    shape = (num_blocks, block_size, num_heads, head_dim)
    k_ref, v_ref = torch.zeros(shape, device=device).to(cache_dtype), torch.zeros(shape, device=device).to(cache_dtype)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    reshape_and_cache_torch(k, v, k_ref, v_ref, slots, k_scale, v_scale)
    reshape_and_cache_triton(k, v, k_out, v_out, slots, k_scale, v_scale)
    # Exact: the kernel rounds to float8 exactly like torch (nearest even, saturating at 448).
    assert torch.equal(k_out.float(), k_ref.float())
    assert torch.equal(v_out.float(), v_ref.float())


def test_fp8_rounding_edges(device):
    # ties, carries into the exponent, subnormals, saturation
    vals = torch.tensor([7.875, 50.0, 52.0, 0.0, 448.0, 460.0, -1000.0, 2**-9 * 1.5, 2**-10, 3 * 2**-10,
                         0.0137, -0.00371], device=device)
    vals = torch.cat((vals, torch.randn(500, device=device) * 30, torch.randn(512, device=device) * 0.01))
    k = vals.view(4, 4, 64)  # few tokens, many values each: the interpreter pays per program
    out = torch.zeros(4, 1, 4, 64, device=device, dtype=torch.float8_e4m3fn)
    reshape_and_cache_triton(k, k, out, out.clone(), torch.arange(4, device=device))
    assert torch.equal(out.flatten().float(), vals.clamp(-448, 448).to(torch.float8_e4m3fn).float())


def test_engine_cache_view_and_empty(device):
    engine = torch.zeros(2, 2, 4, 16, 2, 64, device=device, dtype=torch.float16)  # (L, 2, nb, N, H, C)
    k = torch.randn(3, 2, 64, device=device, dtype=torch.float16)
    v = torch.randn(3, 2, 64, device=device, dtype=torch.float16)
    slots = torch.tensor([0, 17, 63], device=device)
    reshape_and_cache_triton(k, v, engine[1, 0], engine[1, 1], slots)
    ref = torch.zeros_like(engine)
    reshape_and_cache_torch(k, v, ref[1, 0], ref[1, 1], slots)
    assert torch.equal(engine, ref)
    empty = torch.zeros(0, 2, 64, device=device, dtype=torch.float16)
    reshape_and_cache_triton(empty, empty, engine[0, 0], engine[0, 1], torch.zeros(0, dtype=torch.int64, device=device))


def test_argument_errors(device):
    k = torch.randn(2, 2, 64, device=device)
    cache = torch.zeros(4, 16, 2, 64, device=device)
    slots = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache_triton(k, k, cache, cache, slots[:1])
    with pytest.raises(ValueError, match="v must have shape"):
        reshape_and_cache_triton(k, k[:, :1], cache, cache, slots)
    with pytest.raises(ValueError, match="k_scale"):
        reshape_and_cache_triton(k, k, cache, cache, slots, 1.0, 1.0)
    fp8 = cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):
        reshape_and_cache_triton(k, k, fp8, fp8.clone(), slots, torch.ones(3, device=device), 1.0)
    with pytest.raises(ValueError, match="v_cache"):
        reshape_and_cache_triton(k, k, cache, cache[:, :8], slots)
