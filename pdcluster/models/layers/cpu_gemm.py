"""Pre-packed CPU GEMMs: a linear weight reordered once, at load, into oneDNN's blocked layout,
then multiplied with oneDNN's linear primitive.

Why: on CPU, `F.linear` reorders (re-blocks) the weight on every call, which at M = 1 (batch-1
decode) costs as much as the GEMV itself. The pre-packed weight skips that. Measured: bfloat16 on
AVX512-BF16 1.65-2.3x faster at M = 1 and 1.0-1.9x at M = 16-256; float32 on an AVX2-only EPYC
(no BF16, where compute_dtype "auto" runs float32) 1.3-3.3x at M = 1, 1.4-2.2x at M = 32 and
1.0-1.5x at M = 256-2048 (notes in benchmarks/RESULTS.md, session 6).

When: a weight is packed only if it is on the CPU, in a dtype of PACK_DTYPES, oneDNN is
available with both ops, PDCLUSTER_CPU_PREPACK is not "0", and probe products of the packed
weight agree with `F.linear`'s on this machine at every probed row count M:
- bfloat16: bit for bit (same oneDNN kernel, same accumulation order, bias included), probed at
  M = 1, 3, 16, 64 and 256 (PROBE_ROWS_EXACT). Whether the two paths round alike depends on the
  CPU and on M: on one CI machine they agreed at M = 1 and 3 and not at M = 64, where oneDNN
  picks another kernel for one of them. So a bf16 packed copy serves products of up to `max_rows`
  rows, the highest rung below the first disagreement (and at most the top rung: beyond it nothing
  was checked, and on an AMX CPU plain F.linear is faster there anyway: 0.74x packed at M = 2,048,
  benchmarks/packed_linear.py); larger products run F.linear on the plain weight, which therefore
  stays allocated (bf16 packing costs a second copy of the linear weights;
  PDCLUSTER_CPU_PREPACK=0 trades that memory back for the speed);
- float32: within the rounding-error bound of a dot product. F.linear's float32 GEMM is MKL's,
  oneDNN sums in another order, so the two differ in the last bits (as MKL itself does between
  batch sizes); each lies within gamma_K * sum|x_i w_i| of the exact product (gamma_K ~ K * u,
  whatever the order), so a difference beyond twice that is a wrong kernel, not rounding; probed
  at M = 1 and 3 (PROBE_ROWS_BOUND: the bound holds at any M, the probe checks the packed layout).
  Rounding is no contract there, so a float32 copy that passes serves every M and its plain
  weight is released once the forward is built.
float16 is not packed (it needs AVX512-FP16 / AVX-NE-CONVERT).

The packed tensor is an opaque mkldnn tensor: inductor cannot take it as a graph input, so a
traced layer calls the opaque `pdcluster::packed_linear` op instead, which looks the packed weight
up at run time (below); once the forward is built the runner releases the plain weights that no
product reads any more (`release_plain_weights`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdcluster.env_flags import env_enabled

ENV = "PDCLUSTER_CPU_PREPACK"  # "0" / "false" / "off" / "no": never pack
PACK_DTYPES = (torch.bfloat16, torch.float32)
# The probe's M values. Bit-exact (bf16): the decode GEMV, small and mid batches, a prefill chunk's
# GEMM, since which kernel oneDNN picks (and so the rounding) changes with M; two products of the
# real weight per rung at load. Rounding-bound (float32): the GEMV and a small GEMM check the
# packed layout only (a rounding bound holds at any M), since three float32 products per rung up
# to 256 rows cost ~4 s of the 125M bench model's load on a 2-core AVX2 CPU.
PROBE_ROWS_EXACT = (1, 3, 16, 64, 256)
PROBE_ROWS_BOUND = (1, 3)
# The batch-size hint oneDNN lays the packed weight out for (its choice of blocking). bfloat16: 1,
# the decode GEMV's, measured as fast as an M-specific packing at M = 16-256 too (AVX512-BF16).
# float32: 32. On a 2-core AVX2 EPYC (benchmarks/packed_linear.py --hints, session 9) hint 1 left
# small batches on a GEMV-like kernel: M = 4-64 ran 1.3-2x faster packed with hint 16-128 (e.g. M =
# 4 on 768 -> 3072: 37 vs 70 GFLOP/s, M = 32 on the 768 -> 32000 LM head: 53 vs 111), M = 1 alike.
PACK_BATCH_HINT = {torch.bfloat16: 1, torch.float32: 32}


@dataclass(eq=False)
class PackedWeight:
    """A weight's oneDNN-packed copy and the row counts it is proven to serve."""

    blocked: torch.Tensor  # the opaque mkldnn tensor (_reorder_linear_weight of the plain weight)
    max_rows: int | None  # products of more rows run F.linear on the plain weight; None: every M

    def serves(self, x: torch.Tensor) -> bool:
        """Whether x's product (rows = every leading dim) runs packed."""
        return self.max_rows is None or x.numel() <= self.max_rows * x.shape[-1]


def prepack_enabled() -> bool:
    return env_enabled(ENV)


def _ops_available() -> bool:
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def unpackable_reason(weight: torch.Tensor) -> str | None:
    """Why `weight` stays unpacked, or None when it may be packed."""
    if not prepack_enabled():
        return f"{ENV}=0"
    if weight.device.type != "cpu":
        return f"device {weight.device.type}"
    if weight.dtype not in PACK_DTYPES:
        return f"dtype {str(weight.dtype).removeprefix('torch.')}"
    if weight.dim() != 2 or weight.numel() == 0:
        return "not a 2-D weight"
    if not _ops_available():
        return "oneDNN (mkldnn) linear ops unavailable"
    return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ W.T (+ bias) with W packed by `pack_weight`; equals F.linear(x, W, bias)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def probe_agrees(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether the packed product `got` of x @ w.T (+ b) agrees with F.linear's: bit for bit in
    bfloat16, within twice the float32 dot-product error bound (K * eps * sum|x_i w_i|, plus the
    bias add's rounding) in float32."""
    want = F.linear(x, w, b)
    if w.dtype != torch.float32:
        return torch.equal(got, want)
    scale = x.abs() @ w.abs().T
    if b is not None:
        scale = scale + b.abs()
    bound = 2 * (w.shape[1] + 1) * torch.finfo(torch.float32).eps * scale
    return bool(torch.isfinite(got).all()) and bool(((got - want).abs() <= bound).all())


def served_rows(agrees: Sequence[bool], rows: Sequence[int], exact: bool) -> int | None:
    """How many rows a packed copy serves, given whether the probe agreed at each rung of `rows`
    (ascending): 0 when the first rung disagreed (not packed); else the highest rung below the
    first disagreement, except that a copy held only to the rounding bound (float32, `exact`
    False) which agreed everywhere serves every M (None). A bit-exact contract is kept to what was
    checked."""
    served = 0
    for ok, m in zip(agrees, rows, strict=True):
        if not ok:
            return served
        served = m
    return served if exact else None


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """The oneDNN-packed copy of `weight` (out, in) and the rows it serves, or None when it must
    stay unpacked (see `unpackable_reason`, or the probe disagreed with F.linear at M = 1). The
    plain weight is not changed."""
    if unpackable_reason(weight) is not None:
        return None
    w = weight.detach()
    try:
        blocked = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_BATCH_HINT[w.dtype])
        gen = torch.Generator().manual_seed(0)
        b = None if bias is None else bias.detach()
        exact = w.dtype != torch.float32
        ladder = PROBE_ROWS_EXACT if exact else PROBE_ROWS_BOUND
        agrees: list[bool] = []
        for rows in ladder:
            x = torch.randn(rows, w.shape[1], generator=gen).to(w.dtype)
            agrees.append(probe_agrees(packed_linear(x, blocked, b), x, w, b))
            if not agrees[-1]:
                break
    except RuntimeError:  # e.g. a CPU without the ISA this dtype needs in oneDNN
        return None
    max_rows = served_rows(agrees, ladder[: len(agrees)], exact=exact)
    if max_rows == 0:
        return None
    return PackedWeight(blocked, max_rows)


def linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ layer.weight.T (+ bias) outside a trace: packed where the layer's packed copy serves
    x's row count, F.linear on the plain weight otherwise."""
    return _routed(layer, packed_now(layer), x, bias)


def _routed(layer: torch.nn.Module, packed: PackedWeight | None, x: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    if packed is not None and packed.serves(x):
        return packed_linear(x, packed.blocked, bias)
    return F.linear(x, layer.weight, bias)


def packed_now(layer: torch.nn.Module) -> PackedWeight | None:
    """The layer's packed weight to multiply with now, or None: always None while dynamo traces
    (the opaque mkldnn tensor cannot enter an inductor graph: a traced linear calls
    `packed_linear_op` by name instead; checked first, so the trace never even reads the
    attribute: no guard on it)."""
    # is_dynamo_compiling, not is_compiling: torch 2.13's is_compiling() is one process-wide flag,
    # True on every thread while any compile session is open (a background compile).
    if torch.compiler.is_dynamo_compiling():
        return None
    return getattr(layer, "packed_weight", None)


def prepack_model(model: torch.nn.Module) -> tuple[int, int]:
    """Pack every module that can (those with a `prepack()` method: the linear layers and the LM
    head). Returns (packed, candidates)."""
    results = [m.prepack() for m in model.modules() if callable(getattr(m, "prepack", None))]
    return sum(bool(r) for r in results), len(results)


def drop_packed(model: torch.nn.Module) -> None:
    """Forget every packed copy and bfloat16 decode copy (cpu_gemv) before the weights change:
    the layers use F.linear until `prepack_model` runs again."""
    for m in model.modules():
        if getattr(m, "packed_weight", None) is not None:
            m.packed_weight = None
        if getattr(m, "gemv_weight", None) is not None:
            m.gemv_weight = None


def packed_count(model: torch.nn.Module) -> tuple[int, int]:
    """(modules now running packed, modules that could), for reports and benchmarks."""
    mods = [m for m in model.modules() if callable(getattr(m, "prepack", None))]
    return sum(getattr(m, "packed_weight", None) is not None for m in mods), len(mods)


# The decoder layer the compiled forward is running: set by compiled_forward around each layer call
# and read by the `packed_linear` op. A ContextVar (not an attribute): a custom op takes only
# tensors and scalars, and the value is scoped to the call (another thread's engine never sees it).
CURRENT_LAYER: contextvars.ContextVar[torch.nn.Module] = contextvars.ContextVar("pdcluster_compiled_layer")


@torch.library.custom_op("pdcluster::packed_linear", mutates_args=())
def packed_linear_op(x: torch.Tensor, bias: torch.Tensor | None, name: str, out_features: int) -> torch.Tensor:
    """The packed product inside a compiled graph: `name` is the linear's path in the current
    decoder layer (the same string in every layer, so one graph serves them all), and its packed
    weight is looked up at run time, so the opaque mkldnn tensor never enters the graph (nor does
    the plain weight a product of more rows than the packed copy serves multiplies)."""
    layer = CURRENT_LAYER.get().get_submodule(name)
    return _routed(layer, layer.packed_weight, x, bias)


@packed_linear_op.register_fake
def _packed_linear_fake(x: torch.Tensor, bias: torch.Tensor | None, name: str, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def name_packed_layers(layer: torch.nn.Module) -> None:
    """Give every packed linear of one decoder layer its path (`compiled_name`), so that traced
    calls go through `packed_linear_op` instead of F.linear on the plain weight."""
    for name, mod in layer.named_modules():
        if name and getattr(mod, "packed_weight", None) is not None:
            mod.compiled_name = name


def release_plain_weights(model: torch.nn.Module) -> int:
    """Free the plain copy of every packed weight that nothing reads any more: its packed copy
    serves every row count (a bf16 copy serving up to `max_rows` keeps it for larger products),
    and no unpacked module shares it (a tied LM head's weight is the embedding's table: kept).
    Call once the forward is built: from then on those products run packed, eagerly or through
    `packed_linear_op`. Returns the bytes freed."""
    # Weights some unpacked module also reads (the embedding table a tied head shares, any module).
    shared = {id(m.weight) for m in model.modules()
              if getattr(m, "packed_weight", None) is None and isinstance(getattr(m, "weight", None), torch.Tensor)}
    freed = 0
    for mod in model.modules():
        w, packed = getattr(mod, "weight", None), getattr(mod, "packed_weight", None)
        if packed is None or packed.max_rows is not None or w is None or id(w) in shared or w.numel() == 0:
            continue
        nbytes = w.numel() * w.element_size()
        freed += nbytes
        w.data = torch.empty(0, dtype=w.dtype, device=w.device)  # a product on it now fails loudly
        mod.released_weight_bytes = nbytes  # what a step still reads (from the packed copy)
    return freed
