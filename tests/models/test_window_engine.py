"""Sliding windows through the whole engine (LLM -> scheduler -> KV manager -> runner): with every
layer sliding, blocks behind the window are freed while prompts and outputs much longer than the
window run, greedy output stays token-exact vs transformers, the blocks in use stay bounded by the
window (a pool too small for the sequences serves them without preemption), and a second round
hits the prefix cache through the window. A model with a full-attention layer frees nothing."""

from __future__ import annotations

import pytest
import torch
from models.test_model_equivalence import hf_greedy, make_prompts
from models.tiny_archs import make_checkpoint

from pdcluster import LLM, SamplingParams
from pdcluster.config import EngineArgs
from pdcluster.models.layers import cpu_attention
from pdcluster.models.layers.torch_attention import TorchAttentionBackend

MAX_TOKENS = 24
LENS = (29, 11, 38, 3)
BS = 4
# Eager when the engine has a compiled forward: the window is the point here, not compilation.
EAGER = {"enforce_eager": True} if "enforce_eager" in EngineArgs.__dataclass_fields__ else {}


def _llm_with_peak(path: str, **opts) -> tuple[LLM, list[int]]:
    """An LLM whose scheduler records the blocks in use after every schedule()."""
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, max_model_len=128, **EAGER, **opts)
    sched = llm.engine.core.scheduler
    peaks: list[int] = []
    schedule = sched.schedule

    def recording():
        out = schedule()
        peaks.append(sched.kv.make_stats().num_used_blocks)
        return out

    sched.schedule = recording
    return llm, peaks


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]], list[list[int]]]:
    path = make_checkpoint("mistral", tmp_path_factory.mktemp("wmistral"), sliding_window=7)
    prompts = make_prompts(384, lens=LENS, seed=3)
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


@pytest.mark.parametrize("opts", [
    dict(num_kv_blocks=32),  # the four sequences need 45 blocks in all without freeing
    pytest.param(dict(num_kv_blocks=32, max_num_batched_tokens=6, enable_prefix_caching=False),
                 marks=pytest.mark.slow),
    pytest.param(dict(num_kv_blocks=256), marks=pytest.mark.slow),  # room to keep the freed blocks cached
], ids=["pool32", "chunk6-nocache", "pool256-hits"])
def test_window_freeing_is_token_exact_and_bounded(mistral, opts: dict) -> None:
    path, prompts, want = mistral
    llm, peaks = _llm_with_peak(path, **opts)
    assert llm.engine.core.scheduler.kv.sliding_window == 7
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2 if opts["num_kv_blocks"] > 45 else 1):  # a second round hits the prefix cache
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] == 0 and stats["kv_blocks_used"] == 0
    # Each request holds at most the window's blocks plus the step's new tokens' (a chunk).
    chunk = opts.get("max_num_batched_tokens", max(LENS))
    per_request = -(-(7 + chunk) // BS) + 1
    assert max(peaks) <= len(prompts) * per_request
    decode_peak = max(peaks[-MAX_TOKENS // 2:])  # late decode steps: window + one token each
    assert decode_peak <= len(prompts) * (-(-7 // BS) + 2) < 45
    if opts["num_kv_blocks"] > 45:
        assert stats["prefix_cache_hits"] >= sum((n - 1) // BS * BS for n in LENS)


def test_a_full_attention_layer_frees_nothing(tmp_path) -> None:
    """Qwen2 with max_window_layers=1: layer 0 is full attention, so every block stays."""
    path = make_checkpoint("qwen2", tmp_path / "q2", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    prompts = make_prompts(384, lens=(23, 9), seed=5)
    llm, peaks = _llm_with_peak(path, num_kv_blocks=64)
    assert llm.engine.core.scheduler.kv.sliding_window is None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == hf_greedy(path, prompts, 12)
    assert max(peaks) == -(-(23 + 11) // BS) + -(-(9 + 11) // BS)  # every block held to the end


@pytest.mark.parametrize("window", [1, 5, 8])
def test_attention_never_reads_behind_the_window(window: int) -> None:
    """Positions behind each query's window hold NaN (a freed block reused, or never written):
    the output is still finite and equal to the output with those positions zeroed."""
    torch.manual_seed(0)
    hq, hk, d, nb = 4, 2, 8, 48
    context_lens, query_lens = [17, 0, 30, 9], [1, 12, 5, 1]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    width = max(-(-s // BS) for s in seq_lens)
    free = list(range(nb))
    tables, slots = [], []
    for c, s in zip(context_lens, seq_lens):
        blocks = [free.pop() for _ in range(-(-s // BS))]
        tables.append(blocks + [0] * (width - len(blocks)))
        slots += [blocks[p // BS] * BS + p % BS for p in range(c, s)]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    from pdcluster.models.layers.attention_backend import AttentionMetadata

    def meta() -> AttentionMetadata:
        return AttentionMetadata(len(seq_lens), qsl[-1], torch.tensor(qsl, dtype=torch.int32),
                                 torch.tensor(seq_lens, dtype=torch.int32),
                                 torch.tensor(context_lens, dtype=torch.int32),
                                 torch.tensor(tables, dtype=torch.int32), torch.tensor(slots),
                                 max(query_lens), max(seq_lens), query_lens, seq_lens, context_lens)

    k_cache, v_cache = torch.randn(nb, BS, hk, d), torch.randn(nb, BS, hk, d)
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    for table, c in zip(tables, context_lens):
        first_read = max(0, c - window + 1)  # the request's first query sees nothing before
        for p in range(first_read - first_read % BS):  # whole blocks behind the window: freeable
            poisoned_k[table[p // BS], p % BS] = float("nan")
            poisoned_v[table[p // BS], p % BS] = float("nan")
    # Blocks never named by any table (free in the pool) are NaN too.
    for b in free:
        poisoned_k[b], poisoned_v[b] = float("nan"), float("nan")
    q, k, v = torch.randn(qsl[-1], hq, d), torch.randn(qsl[-1], hk, d), torch.randn(qsl[-1], hk, d)
    want = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta(), d**-0.5, sliding_window=window)
    got = TorchAttentionBackend().forward(q, k, v, poisoned_k, poisoned_v, meta(), d**-0.5, sliding_window=window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want)
    assert cpu_attention.build_plan(meta(), BS).decode is not None  # the decode path was exercised


def test_window_freeing_with_an_fp8_cache(mistral) -> None:
    """fp8 KV (the torch backend dequantises the blocks the step's tables name, freed ones too):
    with freeing, the engine gives the tokens of a runner that never frees."""

    from models.test_model_equivalence import run_greedy

    from pdcluster.engine.model_runner import ModelRunner

    path, prompts, _ = mistral
    config = EngineArgs(model=path, dtype="float32", kv_cache_dtype="fp8", block_size=BS, num_kv_blocks=128,
                        device="cpu", attention_backend="torch", ops_backend="torch", **EAGER).create_engine_config()
    want = run_greedy(ModelRunner(config), prompts, max_tokens=MAX_TOKENS)
    llm, peaks = _llm_with_peak(path, num_kv_blocks=32, kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.get_stats()["num_preemptions"] == 0 and max(peaks[-MAX_TOKENS // 2:]) < 45
