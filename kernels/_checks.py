"""Argument checks shared by the Triton launchers.

A wrong stride or dtype reaching a kernel reads or writes the wrong memory without any error, so
every launcher validates its tensors first and raises ValueError naming the offending argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPE = torch.float8_e4m3fn
KV_DTYPES = (*FLOAT_DTYPES, FP8_DTYPE)
INDEX_DTYPES = (torch.int32, torch.int64)
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn; quantisation saturates here instead of NaN


def check_tensor(
    name: str,
    t: object,
    *,
    shape: Sequence[int | None] | None = None,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
) -> torch.Tensor:
    """Validate one launcher argument; `shape` entries of None match any size."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    return t


def check_same(names: str, *values: object) -> None:
    """Raise if the given sizes/dtypes differ, e.g. check_same("k.dtype, v.dtype", k.dtype, v.dtype)."""
    if any(v != values[0] for v in values[1:]):
        raise ValueError(f"{names} must match, got {', '.join(str(v) for v in values)}")


def as_scale(
    name: str, scale: torch.Tensor | float | None, num_heads: int, device: torch.device
) -> tuple[torch.Tensor | None, int]:
    """KV quantisation scale -> (float32 tensor or None, stride between heads).

    Per-tensor scales (a float, a 0-d or 1-element tensor) get head stride 0 so the kernels read
    the same value for every head; per-head scales are (num_kv_heads,) with head stride 1.
    """
    if scale is None:
        return None, 0
    if not isinstance(scale, torch.Tensor):
        # A host float costs one small host->device copy per call; pass a device tensor on hot paths.
        scale = torch.full((1,), float(scale), dtype=torch.float32, device=device)
    if scale.device != device:
        raise ValueError(f"{name} must be on {device}, got {scale.device}")
    if scale.numel() == 1:
        return scale.reshape(1).float(), 0
    if scale.shape != (num_heads,):
        raise ValueError(f"{name} must be a scalar or have shape ({num_heads},) (per KV head), got {tuple(scale.shape)}")
    return scale.float().contiguous(), 1


def kv_scales(
    k_cache_dtype: torch.dtype,
    k_scale: torch.Tensor | float | None,
    v_scale: torch.Tensor | float | None,
    num_kv_heads: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None, int, bool]:
    """The fp8 KV-scale arguments every attention launcher takes, checked the same way:
    -> (k scale, v scale, stride between heads, has_scale).

    Only a float8 cache is scaled (a scale given for any other cache is an error); a missing scale
    of a float8 cache is 1.0; k and v scales must both be per tensor or both per head.
    """
    if k_cache_dtype != FP8_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are only used with a float8 cache, got k_cache.dtype {k_cache_dtype}")
        return None, None, 0, False
    ks, scale_stride = as_scale("k_scale", 1.0 if k_scale is None else k_scale, num_kv_heads, device)
    vs, v_stride = as_scale("v_scale", 1.0 if v_scale is None else v_scale, num_kv_heads, device)
    check_same("k_scale, v_scale granularity (per tensor / per head)", scale_stride, v_stride)
    return ks, vs, scale_stride, True


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
