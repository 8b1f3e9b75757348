"""Paged decode attention on the CPU through the C kernel csrc/paged_decode_cpu.c.

`paged_decode_attention_cpu` has the contract of paged_attention.paged_decode_attention_torch
(the reference it is tested against): q (B, Hq, D), caches (num_blocks, block_size, Hk, D),
block_tables (B, max_blocks), seq_lens (B,), optional sliding window; scores, softmax and the
weighted sum in float32, the result in q's dtype. It returns None where the kernel does not apply
(no compiler, a cache dtype other than float32/bfloat16, non-contiguous caches, a GPU tensor, a
slot row Hk * D over 4096 floats, over 256 query heads): the caller then runs its torch path, so a missing kernel is slower, never wrong.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def declare(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    """`pd_paged_decode` of a library built from csrc/paged_decode_cpu.c, its signature declared
    (also for benchmarks/paged_decode_ab.py's builds of other revisions)."""
    f = lib.pd_paged_decode
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    f.argtypes = [p, p, p, p, ctypes.c_int, p, i64, p, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                  ctypes.c_int]
    f.restype = ctypes.c_int
    return f


@functools.cache
def _fn() -> ctypes._CFuncPtr | None:
    lib = native.load("paged_decode_cpu")
    return None if lib is None else declare(lib)


def available() -> bool:
    return _fn() is not None


def supports(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these caches (checked once per step by the caller)."""
    return (k_cache.device.type == "cpu" and k_cache.dtype in _DTYPES and v_cache.dtype == k_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-2] * k_cache.shape[-1] <= 4096
            and available())


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None) -> torch.Tensor | None:
    if not supports(k_cache, v_cache) or q.device.type != "cpu":
        return None
    b, hq, d = q.shape
    nblk, bs, hk, dk = k_cache.shape
    if dk != d or hq % hk or block_tables.shape[0] != b or seq_lens.shape[0] != b:
        raise ValueError(f"paged_decode_attention_cpu: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, "
                         f"tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)} do not agree")
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    if b and lens.max().item() > tables.shape[1] * bs:
        raise ValueError(f"paged_decode_attention_cpu: a seq_len of {lens.max().item()} needs more than the "
                         f"{tables.shape[1]} blocks of {bs} its table holds")
    rc = _fn()(qf.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _DTYPES[k_cache.dtype],
               tables.data_ptr(), tables.stride(0), lens.data_ptr(), b, hq, hk, d, bs,
               int(sliding_window or 0), float(scale), torch.get_num_threads())
    if rc != 0:
        return None  # out of memory or an unsupported shape inside the kernel: the torch path runs
    return out.to(q.dtype)
