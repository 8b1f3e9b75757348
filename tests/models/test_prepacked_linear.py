"""oneDNN pre-packed CPU weights (models/layers/cpu_gemm.py): the packed bfloat16 layers give
exactly what F.linear gives (decode-sized products that the bf16 decode copy serves, cpu_gemv.py:
the same exact products summed in another order, so within one bf16 rounding of F.linear's), float32
ones agree within the dot product's rounding bound (and a wrong product is refused), the model generates the same tokens with packing on and off, and
packing stays off where it cannot run (float16) or is not wanted (PDCLUSTER_CPU_PREPACK=0)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models.test_model_equivalence import engine_config, make_prompts, run_greedy
from tiny_models import make_tiny_checkpoint

from pdcluster.engine.model_runner import ModelRunner
from pdcluster.models.layers import cpu_gemm, cpu_gemv
from pdcluster.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdcluster.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

BF16 = torch.bfloat16
ROWS = (1, 2, 7, 64, 300)  # decode GEMV, small batches, a prefill-sized GEMM

needs_packing = pytest.mark.skipif(
    cpu_gemm.pack_weight(torch.randn(8, 8, dtype=BF16)) is None,
    reason="this CPU / torch build cannot pack bf16 weights exactly (F.linear is used)")
needs_fp32_packing = pytest.mark.skipif(
    cpu_gemm.pack_weight(torch.randn(8, 8)) is None,
    reason="this CPU / torch build cannot pack float32 weights (oneDNN unavailable)")


def _fill(layer: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _layers(dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    return {
        "replicated+bias": ReplicatedLinear(48, 40, True, dtype),
        "replicated": ReplicatedLinear(48, 40, False, dtype),
        "column+bias": ColumnParallelLinear(48, 72, True, dtype),
        "merged": MergedColumnParallelLinear(48, [64, 64], False, dtype),
        "qkv+bias": QKVParallelLinear(48, 8, 6, 2, True, dtype),
        "row+bias": RowParallelLinear(96, 48, True, dtype),
        "row": RowParallelLinear(96, 48, False, dtype),
        "lm_head": ParallelLMHead(500, 48, dtype),
    }


@needs_packing
@pytest.mark.parametrize("kind", sorted(_layers(BF16)))
def test_packed_layer_equals_f_linear(kind: str) -> None:
    layer = _layers(BF16)[kind]
    _fill(layer)
    in_features = layer.weight.shape[1]
    xs = [torch.randn(m, in_features, dtype=BF16) for m in ROWS]
    xs.append(torch.randn(5, 2 * in_features, dtype=BF16)[:, ::2])  # a strided view of activations
    with torch.inference_mode():
        plain = [layer(x) for x in xs]
    assert layer.prepack() and layer.packed_weight is not None
    with torch.inference_mode():
        for x, want in zip(xs, plain):
            got = layer(x)
            if cpu_gemv.serves(getattr(layer, "gemv_weight", None), x):
                # float32 sums of the same products in another order, each rounded to bf16 once
                w = layer.weight.float()
                bound = 2 * (w.shape[1] + 1) * torch.finfo(torch.float32).eps * (x.float().abs() @ w.abs().T)
                ulp = want.float().abs() * 2.0 ** -7
                assert ((got.float() - want.float()).abs() <= ulp + bound + 1e-30).all(), (kind, x.shape)
            else:
                assert torch.equal(got, want), (kind, x.shape)


class _SumGroup:
    """A stand-in TP group: all_reduce adds the other rank's partial sum."""

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t.add_(self.other)


def test_served_rows_stops_below_the_first_disagreement() -> None:
    rungs = (1, 3, 16, 64, 256)
    assert cpu_gemm.served_rows([True] * 5, rungs, exact=True) == 256  # checked no further
    assert cpu_gemm.served_rows([True] * 5, rungs, exact=False) is None  # a rounding bound: every M
    assert cpu_gemm.served_rows([True, True, False], rungs[:3], exact=True) == 3
    assert cpu_gemm.served_rows([True, True, True, False], rungs[:4], exact=False) == 16
    assert cpu_gemm.served_rows([False], rungs[:1], exact=True) == 0  # not packed


@needs_fp32_packing
@pytest.mark.parametrize("kind", ["qkv+bias", "lm_head"])
def test_products_beyond_max_rows_run_f_linear_on_the_plain_weight(kind: str) -> None:
    # A copy that serves up to 2 rows (as a bf16 copy does up to the probe's last agreeing rung):
    # 1-2 rows multiply the packed weight, 3 rows or more the plain one, bit for bit F.linear; the
    # plain weight is kept for them when the forward releases what nothing reads.
    layer = _layers(torch.float32)[kind]
    _fill(layer)
    assert layer.prepack() and layer.packed_weight.max_rows is None  # float32 serves every M ...
    layer.packed_weight = cpu_gemm.PackedWeight(layer.packed_weight.blocked, max_rows=2)  # ... cap it
    bias = getattr(layer, "bias", None)
    with torch.inference_mode():
        for m in (1, 2, 3, 300):
            x = torch.randn(m, layer.weight.shape[1])
            got = layer(x)
            if kind == "lm_head":
                got = got[:, : layer.weight.shape[0]]
            path = cpu_gemm.packed_linear(x, layer.packed_weight.blocked, bias) if m <= 2 else F.linear(x, layer.weight, bias)
            assert torch.equal(got, path), (kind, m)
            x3 = x.reshape(1, m, -1)  # leading dims count as rows
            assert layer.packed_weight.serves(x3) == (m <= 2)
    assert cpu_gemm.release_plain_weights(layer) == 0 and layer.weight.numel() > 0
    layer.packed_weight = cpu_gemm.PackedWeight(layer.packed_weight.blocked, max_rows=None)
    assert cpu_gemm.release_plain_weights(layer) > 0 and layer.weight.numel() == 0


@needs_packing
def test_row_parallel_shards_reduce_to_the_unpacked_result() -> None:
    full = RowParallelLinear(64, 24, True, BF16)
    _fill(full, seed=3)
    x = torch.randn(3, 64, dtype=BF16)
    ranks = [RowParallelLinear(64, 24, True, BF16, tp_rank=r, tp_size=2) for r in range(2)]
    for layer in ranks:
        layer.weight.weight_loader(layer.weight, full.weight.data)
        layer.bias.weight_loader(layer.bias, full.bias.data)
    partial1 = F.linear(x[:, 32:], ranks[1].weight)  # rank 1's partial, unpacked
    ranks[0].tp_group = _SumGroup(partial1)
    with torch.inference_mode():
        want = ranks[0](x[:, :32])
        assert ranks[0].prepack()
        assert torch.equal(ranks[0](x[:, :32]), want)


def test_float16_stays_unpacked() -> None:
    # fp16 needs AVX512-FP16 / AVX-NE-CONVERT in oneDNN: never packed.
    layer = ReplicatedLinear(16, 8, True, torch.float16)
    _fill(layer)
    assert not layer.prepack() and layer.packed_weight is None


@needs_fp32_packing
@pytest.mark.parametrize("kind", sorted(_layers(torch.float32)))
def test_packed_float32_layer_within_the_rounding_bound(kind: str) -> None:
    layer = _layers(torch.float32)[kind]
    _fill(layer)
    in_features = layer.weight.shape[1]
    xs = [torch.randn(m, in_features) for m in ROWS]
    with torch.inference_mode():
        plain = [layer(x) for x in xs]
    assert layer.prepack() and layer.packed_weight is not None
    with torch.inference_mode():
        for x, want in zip(xs, plain):
            got = layer(x)
            assert got.shape == want.shape
            assert cpu_gemm.probe_agrees(got, x, layer.weight, getattr(layer, "bias", None))
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (kind, x.shape)


def test_float32_probe_refuses_a_wrong_product() -> None:
    w, x = torch.randn(40, 48), torch.randn(3, 48)
    want = F.linear(x, w)
    assert cpu_gemm.probe_agrees(want.clone(), x, w, None)
    off_by_ulps = want + want.abs() * 4 * torch.finfo(torch.float32).eps  # rounding-sized: accepted
    assert cpu_gemm.probe_agrees(off_by_ulps, x, w, None)
    wrong = want.clone()
    wrong[1, 7] += 1e-3 * want.abs().max()  # one element off by far more than rounding
    assert not cpu_gemm.probe_agrees(wrong, x, w, None)
    assert not cpu_gemm.probe_agrees(F.linear(x, w.roll(1, 0)), x, w, None)  # a mis-laid-out weight
    nan = want.clone()
    nan[0, 0] = float("nan")
    assert not cpu_gemm.probe_agrees(nan, x, w, None)


def test_disabled_by_env_falls_back_to_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_gemm.ENV, "0")
    layer = ColumnParallelLinear(16, 8, True, BF16)
    _fill(layer)
    assert cpu_gemm.unpackable_reason(layer.weight) == f"{cpu_gemm.ENV}=0"
    assert not layer.prepack()
    x = torch.randn(2, 16, dtype=BF16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_packing
def test_loading_again_drops_the_stale_packed_copy() -> None:
    layer = ReplicatedLinear(16, 8, False, BF16)
    _fill(layer)
    assert layer.prepack()
    new = torch.randn(8, 16, dtype=BF16)
    layer.weight.weight_loader(layer.weight, new)
    assert layer.packed_weight is None
    x = torch.randn(2, 16, dtype=BF16)
    assert torch.equal(layer(x), F.linear(x, new))


@needs_packing
def test_tied_head_packs_a_copy_and_the_embedding_keeps_its_weight() -> None:
    emb, head = VocabParallelEmbedding(300, 32, BF16), ParallelLMHead(300, 32, BF16)
    head.tie_to(emb)
    emb.weight.data.copy_(torch.randn(300, 32))
    ids, hidden = torch.tensor([0, 5, 299]), torch.randn(4, 32, dtype=BF16)
    want = head(hidden)
    assert head.prepack() and head.weight is emb.weight
    assert torch.equal(head(hidden), want)
    assert torch.equal(emb(ids), emb.weight.data[ids])


@needs_packing
@pytest.mark.slow
def test_compiled_layer_equals_eager_packed() -> None:
    # The traced graph multiplies the plain weight (an mkldnn tensor cannot enter inductor).
    layer = QKVParallelLinear(48, 8, 6, 2, True, BF16)
    _fill(layer)
    assert layer.prepack()
    compiled = torch.compile(layer, fullgraph=True)
    for m in (1, 5, 33):
        x = torch.randn(m, 48, dtype=BF16)
        with torch.inference_mode():
            assert torch.equal(compiled(x), layer(x))


def _runner(path: str, monkeypatch: pytest.MonkeyPatch, pack: bool, dtype: str = "bfloat16") -> ModelRunner:
    monkeypatch.setenv(cpu_gemm.ENV, "1" if pack else "0")
    return ModelRunner(engine_config(path, compute_dtype=dtype))


@needs_fp32_packing
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_greedy_same_tokens_packed_and_unpacked(arch: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # float32 packing is not bit-exact (oneDNN vs MKL summation order) but must not change tokens;
    # the transformers equivalence tests run the packed default too.
    path = make_tiny_checkpoint(arch, tmp_path / arch)
    prompts = make_prompts(384, lens=(9, 30, 1))
    plain = _runner(path, monkeypatch, pack=False, dtype="float32")
    assert cpu_gemm.packed_count(plain.model)[0] == 0
    want = run_greedy(plain, prompts, max_tokens=16, stagger=True)
    packed = _runner(path, monkeypatch, pack=True, dtype="float32")
    n, total = cpu_gemm.packed_count(packed.model)
    assert n == total == 2 * 4 + 1
    assert run_greedy(packed, prompts, max_tokens=16, stagger=True) == want


@needs_packing
# qwen2: tied embeddings, q/k/v bias; qwen2_moe (float32 checkpoint loaded as bf16): the router
# gate, the shared expert's MLP and its 1-wide gate pack, the stacked experts do not.
@pytest.mark.parametrize("arch,linears", [("llama", 2 * 4 + 1), ("qwen2", 2 * 4 + 1), ("qwen2_moe", 2 * 6 + 1)])
def test_bf16_greedy_same_tokens_packed_and_unpacked(arch: str, linears: int, tmp_path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if arch == "qwen2_moe":
        from models.tiny_archs import make_checkpoint

        path = make_checkpoint(arch, tmp_path / arch)
    else:
        path = make_tiny_checkpoint(arch, tmp_path / arch, dtype=BF16)
    prompts = make_prompts(384, lens=(9, 30, 1))
    plain = _runner(path, monkeypatch, pack=False)
    assert cpu_gemm.packed_count(plain.model)[0] == 0
    want = run_greedy(plain, prompts, max_tokens=16, stagger=True)
    packed = _runner(path, monkeypatch, pack=True)
    n, total = cpu_gemm.packed_count(packed.model)
    # per layer qkv, o, gate_up, down (MoE: qkv, o, router gate, shared gate_up, down, gate); the LM head
    assert n == total == linears
    assert run_greedy(packed, prompts, max_tokens=16, stagger=True) == want
    # The parameters keep their names and dtypes; a packed weight's plain copy is released once the
    # runner built its forward (nothing reads it any more), every other value is unchanged.
    a, b = dict(plain.model.named_parameters()), dict(packed.model.named_parameters())
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype for k in a)
    released = [k for k in a if b[k].numel() == 0]
    # Released exactly where the packed copy serves every M (a bf16 copy serves up to max_rows and
    # keeps its plain weight for larger products); a tied head shares the embedding table: kept.
    serves_all = [n for n, m in packed.model.named_modules()
                  if getattr(m, "packed_weight", None) is not None and m.packed_weight.max_rows is None]
    assert sorted(released) == sorted(f"{n}.weight" for n in serves_all
                                      if not (arch == "qwen2" and n == "lm_head"))
    assert all(k.endswith(".weight") for k in released)
    assert all(torch.equal(a[k], b[k]) for k in a if k not in released)
    # What a step still reads from the packed copies (benchmarks/decode_roofline.py counts it).
    assert sum(getattr(m, "released_weight_bytes", 0) for m in packed.model.modules()) == sum(
        a[k].numel() * a[k].element_size() for k in released)
    if arch == "qwen2":
        assert packed.model.lm_head.weight is packed.model.model.embed_tokens.weight
        assert packed.model.lm_head.weight.numel() > 0


@needs_packing
@pytest.mark.slow  # compiles (~30 s on a loaded 2-core machine)
def test_compiled_bf16_engine_same_tokens_packed_and_unpacked(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Compiled prefill steps trace the packed_linear op (the plain weights are released after the
    # warm-up), eager decode steps and the LM head call the packed weights directly: the tokens must
    # not change either way.
    from pdcluster import LLM, SamplingParams
    from pdcluster.engine.compiled_forward import CompiledForward

    monkeypatch.setenv("PDCLUSTER_COMPILE", "1")
    monkeypatch.setenv("PDCLUSTER_COMPILE_START", "wait")  # compiled before the graph count starts
    path = make_tiny_checkpoint("qwen2", tmp_path / "qwen2", dtype=BF16)
    prompts = make_prompts(384, lens=(5, 17, 40, 2))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs, graphs = [], []
    for pack in (False, True):
        monkeypatch.setenv(cpu_gemm.ENV, "1" if pack else "0")
        llm = LLM(path, compute_dtype="bfloat16", max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=64,
                  block_size=8)
        runner = llm.engine.core.runner
        assert isinstance(runner.forward_fn, CompiledForward)
        assert (cpu_gemm.packed_count(runner.model)[0] > 0) == pack
        start = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])  # after the warm-up
        outs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
        graphs.append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - start)
        llm.shutdown()
    assert outs[0] == outs[1]
    assert graphs == [0, 0]  # the steps compiled nothing more (no guard on the packed copies)
