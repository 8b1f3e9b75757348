"""FP8 (e4m3) KV cache on the torch backend: the quantisation is applied as specified.

The reference is a float32-cache engine whose attention backend fake-quantises K and V
(dequantize(quantize(x)) with the same per-layer scales) before writing them: if the fp8 engine
stores value / scale clamped to +-448 and attention reads value * scale, every logit of the two
runs agrees to float32 rounding, through fresh prefill, chunked prefill, prefix-cache hits and
decode. (Greedy agreement with an unquantised cache is measured on the trained demo model by
benchmarks/fp8_kv.py, not asserted on a random one.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from pdcluster.config import EngineArgs
from pdcluster.engine.llm import LLM
from pdcluster.models.layers import kv_quant
from pdcluster.sampling_params import SamplingParams

PROMPTS = [list(range(3, 43)), list(range(50, 75)), [5, 6, 7], list(range(3, 43)) + [9, 9]]  # last: prefix hit
ENGINE = {"max_num_batched_tokens": 16, "kv_cache_memory_bytes": 1 << 22, "max_model_len": 128,
          "attention_backend": "torch", "device": "cpu"}


def _fake_quant_reference(llm: LLM, scales: kv_quant.KVScales) -> None:
    """Make `llm` (a float32 cache) see exactly what an fp8 cache would give back."""
    runner = llm.engine.core.runner
    scales.bind(runner.layer_kv_caches)
    backend = runner.attn_backend
    forward = backend.forward

    def fq_forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window=None):  # type: ignore[no-untyped-def]
        ks, vs = scales.for_cache(k_cache)
        return forward(q, kv_quant.fake_quant(k, ks), kv_quant.fake_quant(v, vs), k_cache, v_cache, meta, scale,
                       sliding_window)

    backend.forward = fq_forward


def _run(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=5)
    outs = []
    for prompts in (PROMPTS[:3], PROMPTS[3:]):  # the second batch hits the first one's cached blocks
        for o in llm.generate(prompts, params):
            c = o.outputs[0]
            outs.append((list(c.token_ids), [{lp.token_id: lp.logprob for lp in [d.sampled, *d.top]} for d in c.logprobs]))
    return outs


def _assert_close(got, want, atol: float = 2e-4) -> None:  # type: ignore[no-untyped-def]
    for (g_tok, g_lp), (w_tok, w_lp) in zip(got, want, strict=True):
        assert g_tok == w_tok
        for g, w in zip(g_lp, w_lp, strict=True):
            assert g.keys() == w.keys()
            assert max(abs(g[t] - w[t]) for t in g) < atol


def _with_scales(src: str, dst: pathlib.Path, num_layers: int, num_kv_heads: int) -> str:
    """A copy of checkpoint `src` with per-KV-head k_scale and a per-tensor v_scale per layer (vLLM names)."""
    dst.mkdir()
    for f in pathlib.Path(src).iterdir():
        (dst / f.name).symlink_to(f)
    tensors = {}
    for i in range(num_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.linspace(0.01, 0.03, num_kv_heads)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.004 * (i + 1))
    save_file(tensors, str(dst / "kv_scales.safetensors"))
    return str(dst)


@pytest.mark.parametrize("scaled", [False, True], ids=["scale1", "checkpoint-scales"])
def test_fp8_engine_matches_fake_quant_reference(tiny_ckpts, tmp_path, scaled: bool) -> None:
    path = tiny_ckpts("qwen3")
    if scaled:
        path = _with_scales(path, tmp_path / "scaled", num_layers=2, num_kv_heads=2)
    fp8 = LLM(path, kv_cache_dtype="fp8", **ENGINE)
    try:
        runner = fp8.engine.core.runner
        assert runner.kv_caches.dtype == torch.float8_e4m3fn
        assert runner.kv_scales.source == ("checkpoint" if scaled else "default 1.0")
        if scaled:
            # A per-tensor v_scale next to a per-head k_scale is widened to per head (one granularity).
            assert runner.kv_scales.k[1].shape == runner.kv_scales.v[1].shape == (2,)
            assert runner.kv_scales.v[1].tolist() == pytest.approx([0.008, 0.008])
        got = _run(fp8)
        scales = kv_quant.load_kv_scales(path, 2, 2, torch.device("cpu"))
    finally:
        fp8.shutdown()
    ref = LLM(path, kv_cache_dtype="auto", **ENGINE)
    try:
        _fake_quant_reference(ref, scales)
        want = _run(ref)
    finally:
        ref.shutdown()
    _assert_close(got, want)
    if scaled:  # the quantisation is real: a plain float32 cache gives measurably other logprobs
        plain = LLM(path, kv_cache_dtype="auto", **ENGINE)
        try:
            base = _run(plain)
        finally:
            plain.shutdown()
        err = max(abs(g[t] - b[t]) for (_, gl), (_, bl) in zip(got, base) for g, b in zip(gl, bl) for t in g if t in b)
        assert err > 1e-3


def test_quantize_clamps_and_round_trips() -> None:
    x = torch.tensor([[[1.0, -2.5, 1000.0, -1e6]]])  # (T=1, Hk=1, D=4)
    one = torch.ones(1)
    q = kv_quant.quantize(x, one)
    assert q.dtype == torch.float8_e4m3fn and torch.isfinite(q.float()).all()
    assert q.float().tolist() == [[[1.0, -2.5, 448.0, -448.0]]]
    per_head = torch.tensor([0.5, 2.0])
    y = torch.randn(3, 2, 8)
    back = kv_quant.dequantize(kv_quant.quantize(y, per_head), per_head)
    assert torch.allclose(back, y, rtol=2 ** -3, atol=2 ** -9 * 2.0)  # e4m3: 3 mantissa bits
    assert torch.equal(kv_quant.fake_quant(y, per_head), back)


def test_fp8_budget_gives_proportionally_more_blocks(tiny_ckpts) -> None:
    path = tiny_ckpts("qwen3")
    budget = {"kv_cache_memory_bytes": 1 << 22, "max_model_len": 128, "device": "cpu"}
    blocks = {}
    for kv in ("float32", "bfloat16", "fp8", "fp8_e4m3", "float8_e4m3fn"):
        cfg = EngineArgs(model=path, kv_cache_dtype=kv, **budget).create_engine_config()
        blocks[kv] = cfg.cache.num_blocks
        assert cfg.cache.kv_cache_dtype == ("float8_e4m3fn" if "8" in kv else kv)
    assert blocks["fp8"] == blocks["fp8_e4m3"] == blocks["float8_e4m3fn"] == 2 * blocks["bfloat16"]
    assert blocks["fp8"] == 4 * blocks["float32"]
    llm = LLM(path, kv_cache_dtype="fp8", **budget)
    try:
        assert llm.num_kv_blocks == blocks["fp8"] == llm.engine.core.runner.kv_caches.shape[2]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("bad", ["fp8_e5m2", "int8", "float8"])
def test_unsupported_kv_cache_dtype_refused(tiny_ckpts, bad: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(model=tiny_ckpts("qwen3"), kv_cache_dtype=bad, device="cpu").create_engine_config()


_TRITON_CHILD = """
import json, sys
from pdcluster.engine.llm import LLM
from pdcluster.sampling_params import SamplingParams
path, device = sys.argv[1], sys.argv[2]
got = {}
for backend in ("torch", "triton"):
    llm = LLM(path, kv_cache_dtype="fp8", attention_backend=backend, ops_backend="torch", device=device,
              max_num_batched_tokens=16, num_kv_blocks=32, max_model_len=64)
    assert llm.engine.core.runner.attn_backend.kv_scales.source == "checkpoint"
    outs = llm.generate([list(range(3, 23)), [5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=1))
    got[backend] = [(o.outputs[0].token_ids, [d.sampled.logprob for d in o.outputs[0].logprobs]) for o in outs]
    llm.shutdown()
print(json.dumps(got))
"""


def test_triton_backend_reads_the_same_fp8_cache(tiny_ckpts, tmp_path) -> None:
    """The Triton backend on an fp8 cache with per-head checkpoint scales decodes what the torch
    backend decodes. Not bit-equal: Triton's extend kernel reads a prefill chunk's own tokens at
    full precision (as vLLM's prefill does), the torch backend reads them back from the cache.
    Without CUDA the kernels run in Triton's interpreter, in a child process: TRITON_INTERPRET must
    be set before anything imports triton (transformers does, when the test checkpoint is made)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = _with_scales(tiny_ckpts("qwen3"), tmp_path / "scaled", num_layers=2, num_kv_heads=2)
    env = {**os.environ, "TRITON_INTERPRET": "1"} if device == "cpu" else dict(os.environ)
    child = subprocess.run([sys.executable, "-c", _TRITON_CHILD, path, device], env=env, capture_output=True,
                           text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    for (t_tok, t_lp), (r_tok, r_lp) in zip(got["triton"], got["torch"], strict=True):
        assert t_tok[0] == r_tok[0]
        same = next((i for i, (a, b) in enumerate(zip(t_tok, r_tok)) if a != b), len(r_tok))
        assert max(abs(a - b) for a, b in zip(t_lp[:same], r_lp[:same])) < 0.1


def test_fp8_tensor_parallel_slices_per_head_scales(tiny_ckpts, tmp_path) -> None:
    """TP=2 over 2 KV heads: each rank keeps its own head's checkpoint scale; greedy tokens are TP=1's."""
    path = _with_scales(tiny_ckpts("qwen3"), tmp_path / "scaled", num_layers=2, num_kv_heads=2)
    prompts, params = [list(range(3, 23)), [5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0)
    got = {}
    for tp in (1, 2):
        llm = LLM(path, kv_cache_dtype="fp8", tensor_parallel_size=tp, device="cpu", num_kv_blocks=32,
                  max_model_len=64, max_num_batched_tokens=16)
        try:
            if tp == 2:  # rank 0 runs here and holds KV head 0
                assert llm.engine.core.runner.runner.kv_scales.k[0].tolist() == pytest.approx([0.01])
            got[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    assert got[1] == got[2]
    cpu = torch.device("cpu")
    # Rank r of TP=2 holds head r; with TP=4 over 2 heads, rank r holds head r * 2 // 4 (replicated).
    for tp, rank, head in ((2, 1, 1), (4, 1, 0), (4, 3, 1)):
        scales = kv_quant.load_kv_scales(path, 2, 2, cpu, tp_rank=rank, tp_size=tp)
        assert scales.k[0].tolist() == pytest.approx([(0.01, 0.03)[head]])
