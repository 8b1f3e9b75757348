"""Decode-step products over a bfloat16 copy of a float32 weight that holds bfloat16 values.

Why: a CPU without BF16 instructions computes in float32 (compute_dtype "auto"), so a bfloat16
checkpoint's weights are widened to float32 at load and oneDNN's packed GEMV (cpu_gemm) reads 4
bytes per weight in every decode step, although each weight carries only 2 bytes of information.
At the few rows of a decode step a linear layer costs the read of its weight, so reading the
checkpoint's 2 bytes and widening in registers (kernels/csrc/gemv_bf16_cpu.c) halves the step's
weight traffic. Measured on a 2-core AVX2 EPYC, the 125M bench Llama's 49 products per step: 1.6-1.8x
oneDNN's packed float32 at M = 1, 1.45x at M = 4, 1.1-1.2x at M = 8-16 with W row-major; the tiled
layout the copy now has (kernels/gemv_bf16_cpu.pack) took M = 1 a further 1.5x, and widening by
shift and mask 5 rows a pass took M = 4-16 to 2.3x / 1.9x / 1.5x of oneDNN (benchmarks/gemv_bf16.py).

Exactness: widening bfloat16 to float32 is exact, so the kernel forms the same float32 products
as F.linear on the float32 weight and differs only in the order of the sum. That is the float32
contract cpu_gemm already holds oneDNN's packed copy to (within twice gamma_K * sum|x_i w_i|),
and the copy is probed against F.linear at load the same way (M = 1 and 3, one reference).

When: a float32 weight on the CPU whose every value is a bfloat16 (a bf16 checkpoint computed in
float32; checked, not assumed), the C kernel built, and PDCLUSTER_CPU_GEMV not "0". Products of up
to MAX_ROWS rows, outside a dynamo trace, take the copy; larger ones run oneDNN / F.linear as before.
Cost: the copy is half the float32 weight again (PDCLUSTER_CPU_GEMV=0 trades that memory back).

A bfloat16 weight (a CPU that computes in bf16) gets a tiled copy too: there the point is not the
bytes (oneDNN reads bf16 already) but the one-call decode step (models/cpu_decode_step.py), which
reads every product from these tiles; so that its step is bit for bit the eager one, the eager
layers' decode-sized bf16 products run on the same kernel (x widened exactly, the float32 result
rounded to bfloat16 once, as oneDNN's bf16 GEMM rounds its float32 sum). Cost: a second copy of
the linear weights (the oneDNN-packed one serves prefill); PDCLUSTER_CPU_GEMV=0 trades it back.
On a CPU with AVX512-BF16 the copy is laid out in pairs for the dot-product kernel
(kernels/csrc/gemv_bf16_dot_cpu.c, gemv_bf16_cpu.has_bf16_dot), which multiplies the bf16 rows
with the instructions oneDNN uses, and serves MAX_ROWS rows. With AMX, or a build without that
kernel, oneDNN's bf16 GEMM out-computes the tiles' widen-and-FMA, so the copy serves fewer rows
(max_rows): only where both are bound by the weight read.
"""

from __future__ import annotations

import functools

import torch

from pdcluster.config import cpu_flags, cpu_has_fast_half_precision
from pdcluster.env_flags import env_enabled
from pdcluster.kernels import gemv_bf16_cpu
from pdcluster.kernels.gemv_bf16_cpu import Bf16Tiles
from pdcluster.models.layers import cpu_gemm

ENV = "PDCLUSTER_CPU_GEMV"  # "0" / "false" / "off" / "no": no bfloat16 decode copies
# Up to this many rows the copy serves. Past ~8 rows both it and oneDNN's float32 GEMM are
# FMA-bound; with 5 rows a pass (kernels/csrc/gemv_bf16_cpu.c) the copy's 49 products of a bench
# Llama step still beat oneDNN's at M = 32 / 48 / 64 (41.8 / 61.9 / 85-90 ms against 53.9 / 72.1 /
# 96-98 ms on a 2-core AVX2 EPYC), and it lets the one-call decode driver (models/cpu_decode_step.py)
# take those steps: batch 48 / 64 decode steps 93-95 -> 78-87 / 120-127 -> 101-102 ms. At 96 rows
# the products are 1.08x, at 128 0.95x: 64 it is (RESULTS.md, session 25; 32 before the 5-row pass).
MAX_ROWS = 64
# bfloat16 inputs on a CPU with bf16 dot products whose kernel build has no dot-product path (or
# that has AMX): there oneDNN's dot-product instructions out-compute the float32 FMA tiles past
# the rows where both are bound by the weight read (AMX tiles far more so). On a 2-core
# AVX512-BF16 EPYC the FMA tiles took 13.1 / 25.2 ms for a step's 49 products at 8 / 16 rows
# against oneDNN bf16's 8.5 / 11.4. With the kernel's bf16 dot-product path (AVX512-BF16, no
# AMX) bf16 inputs get MAX_ROWS: its pair products run 1.5x / 1.2x / 1.05x oneDNN's bf16 GEMM at
# 8 / 16-32 / 64 rows, and bench-Llama decode steps at batch 8 / 16 / 32 took 14.6 / 24.2 / 36.4 ->
# 10.2 / 16.7 / 29.6 ms against session 29's 4-row tiles (RESULTS.md, session 30). Without bf16
# instructions oneDNN emulates bf16 and MAX_ROWS holds.
MAX_ROWS_NATIVE_BF16 = 8
PROBE_ROWS = (1, 3)


def enabled() -> bool:
    return env_enabled(ENV)


def skip_reason(weight: torch.Tensor) -> str | None:
    """Why `weight` gets no bfloat16 decode copy, or None when it may."""
    if not enabled():
        return f"{ENV}=0"
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2
            or weight.numel() == 0):
        return "not a 2-D float32 or bfloat16 CPU weight"
    if not gemv_bf16_cpu.available():
        return "the C kernel is unavailable (kernels/native.py logged why)"
    return None


def decode_copy(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Bf16Tiles | None:
    """The bfloat16 copy of `weight` (out, in) for decode products, in the kernel's tiled layout,
    or None: not applicable (skip_reason), a value that is not a bfloat16 (the copy would round
    it), or the probe disagreed with F.linear."""
    if skip_reason(weight) is not None:
        return None
    w = weight.detach()
    if w.dtype == torch.bfloat16:
        copy: Bf16Tiles | None = gemv_bf16_cpu.pack(w)
        w = w.float()  # the probe's float32 reference: the same products, exactly
    else:
        copy = gemv_bf16_cpu.pack_float32(w)  # None: some value is not a bfloat16
    if copy is None:
        return None
    b = None if bias is None else bias.detach().float()
    # One reference product for both probe sizes: at load this runs for every linear weight, and
    # the reference's error bound reads |W| (a full-size temporary) each time it is formed. A
    # bfloat16 weight serves rows of bfloat16 values (a bf16 model's activations): probed with such.
    bf16_x = weight.dtype == torch.bfloat16
    x = torch.randn(sum(PROBE_ROWS), w.shape[1], generator=torch.Generator().manual_seed(0))
    if bf16_x:
        x = x.bfloat16().float()
    parts = []
    for rows_x in x.split(list(PROBE_ROWS)):
        got = gemv_bf16_cpu.gemv_bf16(rows_x, copy, b, bf16_x=bf16_x)
        if got is None:
            return None
        parts.append(got)
    return copy if cpu_gemm.probe_agrees(torch.cat(parts), x, w, b) else None


@functools.cache
def _bf16_rows() -> int:
    """A fact of this CPU and this build: see MAX_ROWS_NATIVE_BF16."""
    if not cpu_has_fast_half_precision():
        return MAX_ROWS
    if "amx_bf16" not in cpu_flags() and gemv_bf16_cpu.has_bf16_dot():
        return MAX_ROWS
    return MAX_ROWS_NATIVE_BF16


def max_rows(dtype: torch.dtype) -> int:
    """The most rows of a `dtype` input the copies serve (0: none): MAX_ROWS for float32 inputs,
    and for bfloat16 ones too unless this CPU has bf16 dot products that out-compute the kernel
    (then MAX_ROWS_NATIVE_BF16)."""
    if dtype == torch.float32:
        return MAX_ROWS
    return _bf16_rows() if dtype == torch.bfloat16 else 0


def serves(copy: Bf16Tiles | None, x: torch.Tensor) -> bool:
    """Whether x's product runs on the bfloat16 copy: a float32 or bfloat16 input of at most
    max_rows(x.dtype) rows, outside a dynamo trace (the kernel is a ctypes call the graph cannot
    hold; checked first, since dynamo cannot trace max_rows' cached CPU check either)."""
    return (copy is not None and not torch.compiler.is_dynamo_compiling()
            and x.numel() <= max_rows(x.dtype) * x.shape[-1])


def linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ layer.weight.T (+ bias) outside a trace: over the layer's bfloat16 decode copy where it
    serves x, else cpu_gemm.linear (oneDNN's packed copy or F.linear)."""
    copy = getattr(layer, "gemv_weight", None)
    if serves(copy, x):
        if x.dtype == torch.float32:
            out = gemv_bf16_cpu.gemv_bf16(x, copy, bias)
        else:  # bfloat16: widened in (exact), the float32 sum rounded once on the way out
            out = gemv_bf16_cpu.gemv_bf16(x.float(), copy, None if bias is None else bias.float(), bf16_x=True)
            out = None if out is None else out.to(torch.bfloat16)
        if out is not None:
            return out
    return cpu_gemm.linear(layer, x, bias)


def copy_count(model: torch.nn.Module) -> tuple[int, int]:
    """(modules holding a decode copy, bytes of those copies), for logs and benchmarks."""
    copies = [m.gemv_weight for m in model.modules() if getattr(m, "gemv_weight", None) is not None]
    return len(copies), sum(c.nbytes for c in copies)
