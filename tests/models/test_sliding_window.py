"""Sliding windows: which layers slide and how wide, as transformers computes it (Mistral, Mixtral,
Qwen2 max_window_layers, Qwen2-MoE, Qwen3-MoE, SmolLM3), token-exact vs transformers with prompts
and outputs longer than the window; max_model_len is not capped. (The Triton kernels' windows:
tests/kernels/test_sliding_window_kernels.py and test_moe_nope_engine_triton.py.)"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
import transformers
from models.test_layers import build_meta
from models.test_model_equivalence import engine_config, hf_greedy, make_prompts, run_greedy
from models.tiny_archs import make_checkpoint

from pdcluster.engine.model_runner import ModelRunner
from pdcluster.models.hf_config import load_model_config
from pdcluster.models.layers.torch_attention import TorchAttentionBackend

PROMPTS = make_prompts(384, lens=(7, 19, 33, 1))
MAX_TOKENS = 24

CASES = {
    "mistral-w8": ("mistral", {"sliding_window": 8}, (8, 8)),
    "qwen2-w6-from1": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}, (0, 6)),
    "qwen2moe-w5": ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2,
                                  "num_hidden_layers": 3}, (5, 0, 0)),
    "smollm3-w7": ("smollm3", {"use_sliding_window": True, "sliding_window": 7}, (0, 7, 0, 7)),
    "mixtral-w9": ("mixtral", {"sliding_window": 9}, (9, 9)),
    "qwen3moe-w10": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 10}, (10, 10)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("window")
    return {case: make_checkpoint(arch, root / case, **kw) for case, (arch, kw, _) in CASES.items()}


def _hf_windows(path: str) -> tuple[int, ...]:
    """Each transformers layer's window (0: full), read off the model transformers builds."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    # Mistral/Mixtral attention passes config.sliding_window at call time; the others store theirs
    # (Qwen2-MoE only on its sliding layers).
    every_layer = hf.config.sliding_window if hf.config.model_type in ("mistral", "mixtral") else None
    windows = []
    for layer in hf.model.layers:
        window = vars(layer.self_attn).get("sliding_window", every_layer)
        windows.append(int(window or 0))
    return tuple(windows)


@pytest.mark.parametrize("case", list(CASES))
def test_windowed_greedy_matches_transformers(case: str, checkpoints: dict[str, str]) -> None:
    path = checkpoints[case]
    cfg = load_model_config(path)
    assert cfg.layer_windows == CASES[case][2] == _hf_windows(path)
    assert cfg.max_model_len == 256 > cfg.sliding_window  # not capped at the window
    want = hf_greedy(path, PROMPTS, max_tokens=MAX_TOKENS)
    runner = ModelRunner(engine_config(path, block_size=5))
    assert run_greedy(runner, PROMPTS, max_tokens=MAX_TOKENS) == want
    runner = ModelRunner(engine_config(path, block_size=4))
    assert run_greedy(runner, PROMPTS, max_tokens=MAX_TOKENS, chunk_size=6, stagger=True) == want


def test_the_window_changes_the_output(checkpoints: dict[str, str]) -> None:
    """Guards the test above: with the windows dropped the same model generates something else."""
    path = checkpoints["mistral-w8"]
    config = engine_config(path)
    full = dataclasses.replace(config, model=dataclasses.replace(config.model, layer_windows=()))
    assert run_greedy(ModelRunner(full), PROMPTS, max_tokens=MAX_TOKENS) != hf_greedy(path, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize(("context_lens", "query_lens"), [
    ([0, 0, 0], [5, 1, 12]), ([7, 0, 13, 3], [1, 9, 4, 1]), ([4, 11, 0, 22], [1, 1, 1, 1])])
def test_torch_backend_window_mask(context_lens: list[int], query_lens: list[int], window: int) -> None:
    torch.manual_seed(0)
    hq, hk, d, bs, nb = 4, 2, 8, 5, 40
    meta = build_meta(context_lens, query_lens, bs, nb)
    k_cache, v_cache = torch.zeros(nb, bs, hk, d), torch.zeros(nb, bs, hk, d)
    full_k = [torch.randn(c + q, hk, d) for c, q in zip(context_lens, query_lens)]
    full_v = [torch.randn(c + q, hk, d) for c, q in zip(context_lens, query_lens)]
    for i, c in enumerate(context_lens):
        for p in range(c):
            blk = int(meta.block_tables[i, p // bs])
            k_cache[blk, p % bs], v_cache[blk, p % bs] = full_k[i][p], full_v[i][p]
    q = torch.randn(sum(query_lens), hq, d)
    k = torch.cat([fk[c:] for fk, c in zip(full_k, context_lens)])
    v = torch.cat([fv[c:] for fv, c in zip(full_v, context_lens)])
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, d**-0.5, sliding_window=window)
    start = 0
    for i, (c, n) in enumerate(zip(context_lens, query_lens)):
        kk = full_k[i].repeat_interleave(hq // hk, 1)
        vv = full_v[i].repeat_interleave(hq // hk, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + n], kk) * d**-0.5
        qpos, kpos = torch.arange(c, c + n)[:, None], torch.arange(c + n)[None, :]
        scores.masked_fill_((kpos > qpos) | (kpos <= qpos - window), float("-inf"))
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
        torch.testing.assert_close(out[start:start + n], want, atol=1e-5, rtol=1e-5)
        start += n


def test_configs_without_layer_types_derive_them(tmp_path: pathlib.Path) -> None:
    """Older config.json files carry no layer_types: derived as transformers derives them."""
    import json

    path = make_checkpoint("qwen2", tmp_path / "q2", num_hidden_layers=4, use_sliding_window=True,
                           sliding_window=12, max_window_layers=2)
    raw = json.loads((tmp_path / "q2" / "config.json").read_text())
    raw.pop("layer_types")
    (tmp_path / "q2" / "config.json").write_text(json.dumps(raw))
    assert load_model_config(path).layer_windows == (0, 0, 12, 12)
