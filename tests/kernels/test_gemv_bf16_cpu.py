"""The bfloat16-weight GEMV kernels against F.linear on the widened weight: the float32 tiles
(kernels/csrc/gemv_bf16_cpu.c) and the bf16 dot-product pairs (kernels/csrc/gemv_bf16_dot_cpu.c,
on a CPU with AVX512-BF16), and the decode-copy policy (models/layers/cpu_gemv.py) that routes
products to them."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels import gemv_bf16_cpu
from pdcluster.models.layers import cpu_gemm, cpu_gemv
from pdcluster.models.layers.linear import ReplicatedLinear

pytestmark = pytest.mark.skipif(not gemv_bf16_cpu.available(), reason="no C compiler on this machine")
TILES, PAIRS = gemv_bf16_cpu.TILES, gemv_bf16_cpu.PAIRS
needs_pairs = pytest.mark.skipif(not gemv_bf16_cpu.has_bf16_dot(),
                                 reason="the bf16 dot-product kernel needs a CPU with AVX512-BF16")


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Twice the float32 dot-product error bound: any summation order lies within it."""
    scale = x.abs() @ w.abs().T + (0 if b is None else b.abs())
    return 2 * (w.shape[1] + 1) * torch.finfo(torch.float32).eps * scale


# Every tile shape of the kernel (1-5 rows a pass; 6 = 3 + 3, 7 = 4 + 3, 16 = 4 x 4), features
# that leave a partial tile and a partial 64-feature block, K with and without a tail below 8.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 16])
@pytest.mark.parametrize(("n", "k"), [(8, 8), (13, 21), (64, 768), (130, 40), (1, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear_on_the_widened_weight(m: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = gemv_bf16_cpu.gemv_bf16(x, gemv_bf16_cpu.pack(w, TILES), b)
    want = gemv_bf16_cpu.gemv_bf16_torch(x, w, b)
    assert got is not None and got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got - want).abs() <= _bound(x, w.float(), b)).all()


# The pair kernel's pass shapes (one pass up to 8 rows, then passes of up to 6: 9 = 5 + 4, 13 =
# 5 + 4 + 4, 32 = 6 6 5 5 5 5), features that leave a partial 16-lane group and a partial
# 64-feature block, odd K (a padded last pair).
@needs_pairs
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 32])
@pytest.mark.parametrize(("n", "k"), [(8, 8), (13, 21), (64, 768), (130, 40), (1, 3), (200, 2048)])
@pytest.mark.parametrize("bias", [False, True])
def test_pairs_match_linear_on_bf16_rows(m: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).bfloat16().float()
    b = torch.randn(n, generator=g) if bias else None
    copy = gemv_bf16_cpu.pack(w)
    assert copy.layout == PAIRS  # the default for a bf16 weight where the kernel runs
    got = gemv_bf16_cpu.gemv_bf16(x, copy, b, bf16_x=True)
    want = gemv_bf16_cpu.gemv_bf16_torch(x, w, b)
    assert got is not None and got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got - want).abs() <= _bound(x, w.float(), b)).all()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("layout", [TILES, pytest.param(PAIRS, marks=needs_pairs)])
def test_every_thread_count_gives_the_same_result(threads: int, layout: str) -> None:
    """Features are split over threads; each output is summed by one thread in one order."""
    g = torch.Generator().manual_seed(1)
    w = gemv_bf16_cpu.pack(torch.randn(300, 96, generator=g).to(torch.bfloat16), layout)
    x = torch.randn(3, 96, generator=g).bfloat16().float()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemv_bf16_cpu.gemv_bf16(x, w, bf16_x=True)
        torch.set_num_threads(threads)
        assert torch.equal(gemv_bf16_cpu.gemv_bf16(x, w, bf16_x=True), one)
    finally:
        torch.set_num_threads(before)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    """Every row goes through the same operations in every pass shape, so a decode row's product
    is bit for bit the same alone, in a batch, or beside its request's drafts."""
    g = torch.Generator().manual_seed(3)
    w = gemv_bf16_cpu.pack(torch.randn(70, 203, generator=g).to(torch.bfloat16), TILES)
    x = torch.randn(13, 203, generator=g)
    alone = torch.cat([gemv_bf16_cpu.gemv_bf16(x[i:i + 1], w) for i in range(13)])
    for m in range(2, 14):
        assert torch.equal(gemv_bf16_cpu.gemv_bf16(x[:m], w), alone[:m]), m


@pytest.mark.parametrize(("n", "k"), [(203, 203), (4096, 40), (5, 8)])
def test_bf16_rows_agree_and_a_rows_result_does_not_depend_on_the_rows_beside_it(n: int, k: int) -> None:
    """bf16_x (x's values are bfloat16) over the default copy: on a CPU with AVX512-BF16 the
    pairs (one pass up to 8 rows, then passes of up to 6), elsewhere the FMA tiles. Either way
    within the float32 bound of the exact sum, and a row's result is bit for bit the same alone or
    beside any number of rows (features leave partial lane groups and blocks, K a partial pair or
    chunk)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    tiles = gemv_bf16_cpu.pack(w)
    x = torch.randn(64, k, generator=g).bfloat16().float()
    b = torch.randn(n, generator=g)
    alone = torch.cat([gemv_bf16_cpu.gemv_bf16(x[i:i + 1], tiles, b, bf16_x=True) for i in range(64)])
    assert ((alone - gemv_bf16_cpu.gemv_bf16_torch(x, w, b)).abs() <= _bound(x, w.float(), b)).all()
    for m in (2, 5, 6, 7, 8, 9, 11, 12, 13, 18, 25, 64):
        assert torch.equal(gemv_bf16_cpu.gemv_bf16(x[:m], tiles, b, bf16_x=True), alone[:m]), m
    if tiles.layout == TILES:  # then it is the FMA kernel itself
        assert torch.equal(alone, gemv_bf16_cpu.gemv_bf16(x, tiles, b))
    else:  # float32 rows are not the pairs' to take: the caller's own path runs
        assert gemv_bf16_cpu.gemv_bf16(x, tiles, b) is None


def test_strided_rows_and_leading_dims() -> None:
    """x as every other row of a wider buffer, and (B, T, K) inputs: the output keeps x's leading dims."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 24, generator=g).to(torch.bfloat16)
    tiles = gemv_bf16_cpu.pack(w)  # the default layout: bf16 rows below, which both take
    wide = torch.randn(3, 48, generator=g).bfloat16().float()
    x = wide[:, :24]  # row stride 48
    got = gemv_bf16_cpu.gemv_bf16(x, tiles, bf16_x=True)
    assert ((got - gemv_bf16_cpu.gemv_bf16_torch(x, w)).abs() <= _bound(x, w.float(), None)).all()
    x3 = torch.randn(2, 2, 24, generator=g).bfloat16().float()
    got3 = gemv_bf16_cpu.gemv_bf16(x3, tiles, bf16_x=True)
    assert got3.shape == (2, 2, 40)
    torch.testing.assert_close(got3, gemv_bf16_cpu.gemv_bf16_torch(x3, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (4, 8), (5, 9), (13, 21), (64, 768)])
def test_the_tiled_layout_holds_the_weight_and_a_tile_is_one_run(n: int, k: int) -> None:
    w = torch.randn(n, k).to(torch.bfloat16)
    tiles = gemv_bf16_cpu.pack(w, TILES)
    assert torch.equal(tiles.unpack(), w)
    t, c = -(-n // 4), -(-k // 8)
    assert tiles.data.shape == (t, c, 4, 8) and tiles.data.is_contiguous()
    # Chunk 0 of tile 0: rows 0-3, one after another, each row's columns 0-7 stored as
    # 0 4 1 5 2 6 3 7 (the padding is zeros).
    padded = torch.zeros(t * 4, c * 8, dtype=torch.bfloat16)
    padded[:n, :k] = w
    assert torch.equal(tiles.data[0, 0].reshape(-1), padded[:4, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1))
    assert tiles.nbytes == t * c * 32 * 2
    # Strided sources pack to the same tiles.
    assert torch.equal(gemv_bf16_cpu.pack(w.t().contiguous().t(), TILES).data, tiles.data)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (64, 2), (65, 9), (130, 40)])
def test_the_pair_layout_holds_the_weight_and_a_block_is_one_run(n: int, k: int) -> None:
    """Packing is plain torch, so this runs on every CPU, not only where the pair kernel does."""
    w = torch.randn(n, k).to(torch.bfloat16)
    pairs = gemv_bf16_cpu.pack(w, PAIRS)
    assert pairs.layout == PAIRS and torch.equal(pairs.unpack(), w)
    b, p = -(-n // 64), -(-k // 2)
    assert pairs.data.shape == (b, p, 64, 2) and pairs.data.is_contiguous()
    # Pair 0 of block 0: features 0-63, each as its columns 0 and 1 (the padding is zeros).
    padded = torch.zeros(b * 64, p * 2, dtype=torch.bfloat16)
    padded[:n, :k] = w
    assert torch.equal(pairs.data[0, 0], padded[:64, :2])
    assert torch.equal(pairs.data[-1, -1], padded[-64:, -2:])
    assert pairs.nbytes == b * p * 128 * 2
    assert torch.equal(gemv_bf16_cpu.pack(w.t().contiguous().t(), PAIRS).data, pairs.data)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 9), (13, 21), (64, 768)])
def test_packing_float32_equals_packing_its_bf16_values_and_refuses_other_values(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 100 + k)
    values = torch.randn(n, 2 * k, generator=g).to(torch.bfloat16)
    strided = values.float()[:, :k]  # row stride 2k
    tiles = gemv_bf16_cpu.pack_float32(strided)
    assert tiles is not None and torch.equal(tiles.data, gemv_bf16_cpu.pack(values[:, :k], TILES).data)
    assert torch.equal(tiles.unpack().float(), strided)
    off = strided.clone()
    off[n - 1, k - 1] = torch.nextafter(off[n - 1, k - 1], torch.tensor(float("inf")))  # not a bf16
    assert gemv_bf16_cpu.pack_float32(off) is None
    with pytest.raises(ValueError, match="float32"):
        gemv_bf16_cpu.pack_float32(values)


def test_declines_what_it_does_not_take_and_names_disagreeing_shapes() -> None:
    w = gemv_bf16_cpu.pack(torch.randn(8, 16).to(torch.bfloat16), TILES)
    with pytest.raises(ValueError, match="layout"):
        gemv_bf16_cpu.pack(torch.randn(8, 16).to(torch.bfloat16), "rows")
    # A pair copy takes rows of bf16 values only; where no pair kernel runs, none at all.
    pairs = gemv_bf16_cpu.pack(torch.randn(8, 16).to(torch.bfloat16), PAIRS)
    assert gemv_bf16_cpu.gemv_bf16(torch.randn(1, 16), pairs) is None
    got = gemv_bf16_cpu.gemv_bf16(torch.randn(1, 16).bfloat16().float(), pairs, bf16_x=True)
    assert (got is not None) == gemv_bf16_cpu.has_bf16_dot()
    assert gemv_bf16_cpu.gemv_bf16(torch.randn(1, 16).double(), w) is None  # float64 input
    with pytest.raises(ValueError, match="bfloat16"):
        gemv_bf16_cpu.pack(torch.randn(8, 16))  # a float32 weight is not packed
    with pytest.raises(ValueError, match="do not agree"):
        gemv_bf16_cpu.gemv_bf16(torch.randn(1, 15), w)
    with pytest.raises(ValueError, match="do not agree"):
        gemv_bf16_cpu.gemv_bf16(torch.randn(1, 16), w, torch.zeros(7))
    assert gemv_bf16_cpu.gemv_bf16(torch.randn(0, 16), w).shape == (0, 8)


def _layer(values: torch.Tensor, bias: bool = False) -> ReplicatedLinear:
    layer = ReplicatedLinear(values.shape[1], values.shape[0], bias, torch.float32)
    layer.weight.data.copy_(values)
    if bias:
        layer.bias.data.copy_(torch.randn(values.shape[0]))
    layer.prepack()
    return layer


def test_a_bf16_valued_layer_gets_a_copy_and_decode_rows_use_it() -> None:
    values = torch.randn(48, 32).to(torch.bfloat16).float()
    layer = _layer(values, bias=True)
    assert layer.gemv_weight is not None and layer.gemv_weight.data.dtype == torch.bfloat16
    assert torch.equal(layer.gemv_weight.unpack().float(), values)
    for rows in (1, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1, 40):
        x = torch.randn(rows, 32)
        got = layer(x)
        want = torch.nn.functional.linear(x, values, layer.bias)
        assert ((got - want).abs() <= _bound(x, values, layer.bias)).all()
        # Up to MAX_ROWS the copy serves; above, oneDNN / F.linear runs as before.
        assert cpu_gemv.serves(layer.gemv_weight, x) == (rows <= cpu_gemv.MAX_ROWS)
    # The routed product equals the kernel's own on the copy, bit for bit.
    x = torch.randn(2, 32)
    assert torch.equal(layer(x), gemv_bf16_cpu.gemv_bf16(x, layer.gemv_weight, layer.bias))


def test_bfloat16_rows_served_up_to_this_cpus_limit(monkeypatch) -> None:
    """A bf16 layer (a CPU that computes in bf16): its decode rows run the kernel (bf16_x: dot
    products where the CPU has them), rounded once on the way out, up to max_rows(bfloat16)."""
    values = torch.randn(48, 32).to(torch.bfloat16)
    layer = ReplicatedLinear(32, 48, True, torch.bfloat16)
    layer.weight.data.copy_(values)
    layer.bias.data.copy_(torch.randn(48).bfloat16())
    layer.prepack()
    assert layer.gemv_weight is not None
    x = torch.randn(3, 32).bfloat16()
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, gemv_bf16_cpu.gemv_bf16(x.float(), layer.gemv_weight, layer.bias.float(),
                                                    bf16_x=True).bfloat16())
    for limit in (cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS_NATIVE_BF16):
        monkeypatch.setattr(cpu_gemv, "_bf16_rows", lambda limit=limit: limit)
        assert cpu_gemv.max_rows(torch.bfloat16) == limit
        assert cpu_gemv.max_rows(torch.float32) == cpu_gemv.MAX_ROWS  # float32 inputs never change
        for rows in (1, limit, limit + 1):
            assert cpu_gemv.serves(layer.gemv_weight, torch.randn(rows, 32).bfloat16()) == (rows <= limit)
    assert cpu_gemv.max_rows(torch.float16) == 0  # nothing else is served
    assert not cpu_gemv.serves(layer.gemv_weight, torch.randn(1, 32).half())


@pytest.mark.parametrize(("flags", "dot", "limit"), [
    (frozenset({"avx2"}), False, "MAX_ROWS"),                                   # oneDNN emulates bf16
    (frozenset({"avx512_bf16"}), True, "MAX_ROWS"),                             # the kernel's dot products
    (frozenset({"avx512_bf16"}), False, "MAX_ROWS_NATIVE_BF16"),                # a build without them
    (frozenset({"avx512_bf16", "amx_bf16"}), True, "MAX_ROWS_NATIVE_BF16"),     # AMX tiles out-compute it
])
def test_how_many_bfloat16_rows_the_copy_serves_on_each_cpu(monkeypatch, flags, dot, limit) -> None:
    monkeypatch.setattr(cpu_gemv, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_gemv, "cpu_has_fast_half_precision", lambda: bool(flags & {"avx512_bf16"}))
    monkeypatch.setattr(gemv_bf16_cpu, "has_bf16_dot", lambda: dot)
    assert cpu_gemv._bf16_rows.__wrapped__() == getattr(cpu_gemv, limit)


def test_no_copy_for_values_bf16_cannot_hold_or_when_switched_off(monkeypatch) -> None:
    g = torch.Generator().manual_seed(3)
    full = torch.randn(16, 16, generator=g)  # float32 values with mantissa bits bf16 lacks
    assert _layer(full).gemv_weight is None
    one_off = torch.randn(16, 16, generator=g).to(torch.bfloat16).float()
    one_off[3, 5] += 1e-6  # a single value that is not a bfloat16
    assert _layer(one_off).gemv_weight is None
    monkeypatch.setenv(cpu_gemv.ENV, "0")
    assert cpu_gemv.skip_reason(one_off) == f"{cpu_gemv.ENV}=0"
    assert _layer(torch.randn(16, 16).to(torch.bfloat16).float()).gemv_weight is None
    assert cpu_gemv.decode_copy(torch.randn(4, 4).bfloat16()) is None  # bf16 compute: oneDNN's bf16


def test_drop_packed_forgets_the_copy() -> None:
    layer = _layer(torch.randn(16, 16).to(torch.bfloat16).float())
    assert layer.gemv_weight is not None
    cpu_gemm.drop_packed(layer)
    assert layer.gemv_weight is None and layer.packed_weight is None
