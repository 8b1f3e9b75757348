"""Prefill attention on the CPU through the C kernel csrc/prefill_attn_cpu.c: every prompt chunk of
a step in one call, K/V read from the paged cache in place.

`Chunks.build` checks a step's chunks once; `prefill_attention_cpu` has the contract of
cpu_attention's SDPA path for the chunks it is given: q (T, Hq, D) (rows may be strided, as a view
into the fused QKV output), caches (num_blocks, block_size, Hk, D) holding every chunk's K/V
already, one block-table row per chunk, each chunk at positions context_len .. context_len + len - 1; causal, optional sliding window; scores and
softmax in float32. The result is (T, Hq, D) in q's dtype, rows outside the chunks left as zeros.
It returns None where the kernel does not apply (no compiler, PDCLUSTER_NATIVE=0 or
PDCLUSTER_CPU_PREFILL_ATTN=0, q's dtype other than the cache's, a dtype other than float32, or
bfloat16 without the build's AVX512-BF16 path, head_dim not a multiple of 16 or over 256, a GPU
tensor): the caller then runs its torch path, so a missing kernel is slower, never wrong.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from pdcluster.env_flags import env_enabled

from . import native

ENV = "PDCLUSTER_CPU_PREFILL_ATTN"  # "0": prefill attention stays on torch's SDPA
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def declare(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    """`pd_prefill_attn` of a library built from csrc/prefill_attn_cpu.c, its signature declared."""
    f = lib.pd_prefill_attn
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    f.argtypes = [p, p, p, p, ctypes.c_int, p, i64, p, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                  ctypes.c_int]
    f.restype = ctypes.c_int
    return f


@functools.cache
def _lib() -> ctypes.CDLL | None:
    return native.load("prefill_attn_cpu")


@functools.cache
def _fn() -> ctypes._CFuncPtr | None:
    lib = _lib()
    return None if lib is None else declare(lib)


def available() -> bool:
    """Whether the kernel is built (building it now, or loading it from the disk cache, if not)."""
    return env_enabled(ENV) and _fn() is not None


@functools.cache
def has_bf16() -> bool:
    """Whether this build multiplies bfloat16 inputs (AVX512-BF16's dot products)."""
    lib = _lib()
    return lib is not None and bool(lib.pd_prefill_has_bf16())


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this layer's inputs (cheap: checked per layer by the caller)."""
    d = q.shape[-1]
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous() and d % 16 == 0 and d <= 256
            and q.stride(-1) == 1 and q.stride(-2) == d and env_enabled(ENV) and _fn() is not None
            and (q.dtype == torch.float32 or has_bf16()))


@dataclass(frozen=True)
class Chunks:
    """A step's prompt chunks for the kernel, checked once (every layer of the step reuses them)."""

    tables: torch.Tensor  # (n, max_blocks) int32: each chunk's block-table row
    cols: torch.Tensor  # (3, n) int64: first q row, query length, context length
    num_tokens: int  # the q rows they were checked against (q may have more: padding)
    block_size: int

    @classmethod
    def build(cls, tables: torch.Tensor, rows: torch.Tensor, num_tokens: int, block_size: int) -> Chunks:
        """rows: (n, 3) int64 (first q row, length, context_len), one per row of `tables`."""
        n = rows.shape[0]
        if (tables.shape[0] != n or tables.dtype != torch.int32 or not tables.is_contiguous()
                or rows.dtype != torch.int64 or rows.shape[1:] != (3,)):
            raise ValueError(f"prefill_attention_cpu: tables {tuple(tables.shape)} {tables.dtype} and chunks "
                             f"{tuple(rows.shape)} {rows.dtype} do not agree")
        cols = rows.t().contiguous()
        # The kernel trusts these: a row past q or a position past its table would read out of bounds.
        if n and (int((cols[0] + cols[1]).max()) > num_tokens or int(cols.min()) < 0
                  or int((cols[2] + cols[1]).max()) > tables.shape[1] * block_size):
            raise ValueError(f"prefill_attention_cpu: chunks {rows.tolist()} do not fit {num_tokens} q rows or "
                             f"tables of {tables.shape[1]} blocks of {block_size}")
        return cls(tables, cols, num_tokens, block_size)


def prefill_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunks: Chunks,
                          scale: float, sliding_window: int | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Writes the chunks' rows of `out` (a fresh zeroed (T, Hq, D) tensor if None) and returns it."""
    if not supports(q, k_cache, v_cache):
        return None
    t, hq, d = q.shape
    nblk, bs, hk, dk = k_cache.shape
    if dk != d or hq % hk or t < chunks.num_tokens or bs != chunks.block_size:
        raise ValueError(f"prefill_attention_cpu: q {tuple(q.shape)} and cache {tuple(k_cache.shape)} do not agree "
                         f"with chunks checked for {chunks.num_tokens} rows and blocks of {chunks.block_size}")
    if out is None:
        out = torch.zeros(t, hq, d, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous() or out.device != q.device:
        raise ValueError(f"prefill_attention_cpu: out {tuple(out.shape)} {out.dtype} must be a contiguous "
                         f"{tuple(q.shape)} {q.dtype} tensor (the kernel writes it as one)")
    tables, cols = chunks.tables, chunks.cols
    rc = _fn()(q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _DTYPES[q.dtype],
               tables.data_ptr(), tables.stride(0), cols[0].data_ptr(), cols[1].data_ptr(), cols[2].data_ptr(),
               cols.shape[1], hq, hk, d, bs, q.stride(0), int(sliding_window or 0), float(scale),
               torch.get_num_threads())
    return out if rc == 0 else None
