"""Small-batch linear products over bfloat16 weights, through two C kernels: y = x @ W.T (+ bias),
x (..., K) float32, W (N, K) bfloat16, y float32.

A weight is laid out once for its kernel (`pack`), in one of two layouts:
- TILES (csrc/gemv_bf16_cpu.c): rows in tiles of 4, each tile one sequential run of 64-byte lines,
  each row's 8 values of a line in the order 0 4 1 5 2 6 3 7. Float32 arithmetic (AVX2/FMA): the
  products are exactly those of F.linear(x, W.float()) (a bfloat16 value widens to float32
  without rounding); only the order of the sum differs. Serves any float32 x.
- PAIRS (csrc/gemv_bf16_dot_cpu.c): features in blocks of 64, K in pairs, for the bf16
  dot-product instructions of a CPU with AVX512-BF16. Serves x whose values are bfloat16
  (`bf16_x`: a bfloat16 model's activations); the products of bf16 pairs are exact too.
`pack` picks PAIRS for a bfloat16 weight where that kernel runs (has_bf16_dot), TILES otherwise;
`pack_float32` (a float32 weight holding bf16 values) always TILES.

`gemv_bf16` returns None where no kernel applies (no compiler, PDCLUSTER_NATIVE=0, a GPU tensor,
another input dtype, a PAIRS weight with x not bf16-valued): the caller then runs its own path,
so a missing kernel is slower, never wrong. The reference it is tested against is
`gemv_bf16_torch`.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import native

TILE_ROWS, CHUNK = 4, 8  # csrc/gemv_bf16_cpu.c's layout
HALF = CHUNK // 2  # a row's 8 values of a chunk are stored as columns 0 4 1 5 2 6 3 7
PAIR_BLOCK = 64  # csrc/gemv_bf16_dot_cpu.c's layout: features per block, K in pairs
TILES, PAIRS = "tiles", "pairs"
LAYOUTS = (TILES, PAIRS)


@dataclass(frozen=True)
class Bf16Tiles:
    """A (n, k) bfloat16 weight in a kernel's layout, zero padded at both ends.
    TILES: `data` is (ceil(n / 4), ceil(k / 8), 4, 8); data[t, c, j, 2 * i + h] is W[4t + j, 8c + 4h + i].
    PAIRS: `data` is (ceil(n / 64), ceil(k / 2), 64, 2); data[b, p, j, h] is W[64b + j, 2p + h]."""

    data: torch.Tensor
    n: int
    k: int
    layout: str = TILES

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def unpack(self) -> torch.Tensor:
        """The (n, k) bfloat16 weight this copy holds."""
        if self.layout == PAIRS:
            b, p = self.data.shape[:2]
            rows = self.data.permute(0, 2, 1, 3).reshape(b * PAIR_BLOCK, p * 2)
        else:
            t, c = self.data.shape[:2]
            rows = self.data.view(t, c, TILE_ROWS, HALF, 2).permute(0, 2, 1, 4, 3)  # (t, 4, c, h, i)
            rows = rows.reshape(t * TILE_ROWS, c * CHUNK)
        return rows[: self.n, : self.k].contiguous()


def pack(weight: torch.Tensor, layout: str | None = None) -> Bf16Tiles:
    """`weight` (N, K) bfloat16 on the CPU, any strides, in a kernel's layout (a copy): `layout`,
    or by default PAIRS where the dot-product kernel runs (has_bf16_dot), else TILES."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError(f"pack: a 2-D bfloat16 CPU weight is needed, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    layout = layout or default_layout()
    if layout not in LAYOUTS:
        raise ValueError(f"pack: layout must be one of {LAYOUTS}, got {layout!r}")
    n, k = weight.shape
    if layout == PAIRS:
        blocks, pairs = -(-n // PAIR_BLOCK), -(-k // 2)
        padded = torch.zeros(blocks * PAIR_BLOCK, pairs * 2, dtype=torch.bfloat16)
        padded[:n, :k] = weight
        data = padded.view(blocks, PAIR_BLOCK, pairs, 2).permute(0, 2, 1, 3).contiguous()
        return Bf16Tiles(data, n, k, PAIRS)
    tiles, chunks = -(-n // TILE_ROWS), -(-k // CHUNK)
    padded = torch.zeros(tiles * TILE_ROWS, chunks * CHUNK, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    data = padded.view(tiles, TILE_ROWS, chunks, 2, HALF).permute(0, 2, 1, 4, 3).contiguous()  # (t, c, 4, i, h)
    return Bf16Tiles(data.view(tiles, chunks, TILE_ROWS, CHUNK), n, k)


def pack_float32(weight: torch.Tensor) -> Bf16Tiles | None:
    """`weight` (N, K) float32 on the CPU straight into the kernel's layout, in one pass and
    without a temporary (this runs for every linear weight at load), or None when some value is
    not a bfloat16 (the copy would round it) or the kernel is unavailable."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_float32: a 2-D float32 CPU weight is needed, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    fns = _fns()
    if fns is None:
        return None
    n, k = weight.shape
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    data = torch.empty(-(-n // TILE_ROWS), -(-k // CHUNK), TILE_ROWS, CHUNK, dtype=torch.bfloat16)
    rc = fns.pack(w.data_ptr(), max(w.stride(0), k), n, k, data.data_ptr(), torch.get_num_threads())
    if rc < 0:
        raise ValueError(f"pack_float32: the kernel refused weight {tuple(weight.shape)} (code {rc})")
    return Bf16Tiles(data, n, k) if rc == 0 else None


class _Fns(NamedTuple):
    product: ctypes._CFuncPtr  # pd_gemv_bf16: float32 rows over TILES
    pack: ctypes._CFuncPtr  # pd_pack_bf16_from_f32
    pairs: ctypes._CFuncPtr | None  # pd_gemv_pairs: bfloat16-valued rows over PAIRS; None: not here


_GEMV_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
              ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]


@functools.cache
def _fns() -> _Fns | None:
    """The kernels' entry points from the built libraries, or None (the TILES one is needed; the
    PAIRS one only where it builds with dot products)."""
    lib = native.load("gemv_bf16_cpu")
    if lib is None:
        return None
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    f = lib.pd_gemv_bf16
    f.argtypes, f.restype = _GEMV_ARGS, c_int
    g = lib.pd_pack_bf16_from_f32
    g.argtypes = [p, i64, i64, i64, p, c_int]
    g.restype = c_int
    dot = native.load("gemv_bf16_dot_cpu")
    pairs = None
    if dot is not None and dot.pd_gemv_pairs_available():
        pairs = dot.pd_gemv_pairs
        pairs.argtypes, pairs.restype = _GEMV_ARGS, c_int
    return _Fns(f, g, pairs)


def has_bf16_dot() -> bool:
    """Whether products of bfloat16-valued rows (bf16_x=True) run on bf16 dot-product
    instructions here (a build for a CPU with AVX512-BF16): then `pack` lays bf16 weights out
    as PAIRS."""
    fns = _fns()
    return fns is not None and fns.pairs is not None


def default_layout() -> str:
    """The layout `pack` gives a bfloat16 weight here: PAIRS where the dot-product kernel runs."""
    return PAIRS if has_bf16_dot() else TILES


def product_fn(layout: str) -> ctypes._CFuncPtr | None:
    """The C entry point that multiplies over `layout` (for the one-call decode driver), or None."""
    fns = _fns()
    if fns is None:
        return None
    return fns.pairs if layout == PAIRS else fns.product


def available() -> bool:
    return _fns() is not None


def gemv_bf16_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())


def gemv_bf16(x: torch.Tensor, tiles: Bf16Tiles, bias: torch.Tensor | None = None,
              bf16_x: bool = False) -> torch.Tensor | None:
    """x (..., K) float32 @ W.T (+ bias) over W's copy, or None where no kernel can run.
    bf16_x: every value of x is a bfloat16 (a bf16 model's activations, widened); a PAIRS copy
    needs it (its kernel multiplies bf16 pairs: the same exact products summed in another order)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32
            or (bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"))):
        return None
    n, k = tiles.n, tiles.k
    if x.shape[-1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"gemv_bf16: x {tuple(x.shape)}, weight {(n, k)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not agree")
    fn = product_fn(tiles.layout)
    if fn is None or (tiles.layout == PAIRS and not bf16_x):
        return None
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    b = None if bias is None else bias.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    rc = fn(x2.data_ptr(), max(x2.stride(0), k), tiles.data.data_ptr(), None if b is None else b.data_ptr(),
            out.data_ptr(), x2.shape[0], n, k, torch.get_num_threads())
    if rc != 0:
        return None
    return out.reshape(*x.shape[:-1], n)
