"""Token-exact equivalence with transformers: tiny random checkpoints saved by transformers, loaded
by our loader, driven through ModelRunner with hand-built SchedulerOutputs."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from tiny_models import TINY_ARCHS, hf_greedy, make_tiny_checkpoint

from pdcluster.config import EngineArgs, EngineConfig
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pdcluster.sampling_params import SamplingParams

PROMPT_LENS = (7, 19, 33, 1)
MAX_TOKENS = 32
ARCHS = sorted(TINY_ARCHS)


def make_prompts(vocab_size: int, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lens]


def engine_config(path: str, block_size: int = 16, num_blocks: int = 128, dtype: str = "auto",
                  compute_dtype: str = "auto") -> EngineConfig:
    return EngineArgs(model=path, dtype=dtype, compute_dtype=compute_dtype, block_size=block_size,
                      num_kv_blocks=num_blocks, device="cpu", attention_backend="torch",
                      ops_backend="torch").create_engine_config()


def run_greedy(runner: ModelRunner, prompts: list[list[int]], max_tokens: int = MAX_TOKENS,
               chunk_size: int | None = None, stagger: bool = False, seed: int = 0) -> list[list[int]]:
    """A minimal scheduler: blocks allocated on demand from a shuffled free list (and reused after a
    request finishes), prompts prefilled in chunks of `chunk_size`, then one token per step.
    `stagger` admits one request per step, so prefills and decodes share steps."""
    bs = runner.block_size
    free = list(range(runner.config.cache.num_blocks))
    random.Random(seed).shuffle(free)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs: dict[str, dict] = {}
    waiting = [(f"r{i}", p) for i, p in enumerate(prompts)]
    finished: set[str] = set()
    results: dict[str, list[int]] = {}
    while waiting or reqs:
        for rid, p in waiting[: 1 if stagger else len(waiting)]:
            reqs[rid] = {"tokens": list(p), "computed": 0, "blocks": [], "new": True, "out": []}
        waiting = waiting[1:] if stagger else []
        new, cached, sched = [], [], {}
        for rid, r in reqs.items():
            n = len(r["tokens"]) - r["computed"]
            n = min(n, chunk_size) if chunk_size else n
            need = -(-(r["computed"] + n) // bs) - len(r["blocks"])
            got = [free.pop() for _ in range(need)]
            r["blocks"] += got
            sched[rid] = n
            if r.pop("new", False):
                new.append(NewRequestData(rid, list(r["tokens"]), [], params, list(r["blocks"]), 0))
            else:
                cached.append(CachedRequestData(rid, got, r["computed"]))
        out = runner.execute(SchedulerOutput(new, cached, sched, sum(sched.values()), finished))
        finished = set()
        assert out.request_ids == list(sched)
        for rid, toks in zip(out.request_ids, out.sampled_token_ids):
            r = reqs[rid]
            r["computed"] += sched[rid]
            assert len(toks) == (1 if r["computed"] == len(r["tokens"]) else 0)
            r["tokens"] += toks
            r["out"] += toks
            if len(r["out"]) == max_tokens:
                results[rid] = r["out"]
                free += reqs.pop(rid)["blocks"]
                finished.add(rid)
    # An empty step still drops the state of the requests that finished last.
    assert runner.execute(SchedulerOutput([], [], {}, 0, finished)).request_ids == []
    assert runner.requests == {}
    return [results[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_outputs(checkpoints: dict[str, str]) -> dict[str, list[list[int]]]:
    return {arch: hf_greedy(path, make_prompts(384), MAX_TOKENS) for arch, path in checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(arch: str, checkpoints: dict[str, str]) -> None:
    path = checkpoints[arch]
    runner = ModelRunner(engine_config(path, block_size=5))
    prompts = make_prompts(384)
    params = SamplingParams(temperature=0.0)
    so = SchedulerOutput(
        [NewRequestData(f"r{i}", p, [], params, list(range(i * 8, i * 8 + 7)), 0) for i, p in enumerate(prompts)],
        [], {f"r{i}": len(p) for i, p in enumerate(prompts)}, sum(map(len, prompts)))
    runner.update_states(so)
    reqs = list(runner.requests.values())
    input_ids, positions, meta = runner.prepare_inputs(reqs, [len(p) for p in prompts])
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(input_ids, positions, runner.kv_caches, meta))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts]).float()
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch: str, block_size: int, checkpoints: dict[str, str],
                                     hf_outputs: dict[str, list[list[int]]]) -> None:
    runner = ModelRunner(engine_config(checkpoints[arch], block_size=block_size))
    got = run_greedy(runner, make_prompts(384))
    assert got == hf_outputs[arch]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_and_mixed_batches_match(arch: str, checkpoints: dict[str, str],
                                                 hf_outputs: dict[str, list[list[int]]]) -> None:
    runner = ModelRunner(engine_config(checkpoints[arch], block_size=5))
    # Chunks of 20: the 33-token prompt takes two steps; staggered arrivals mix prefill and decode.
    assert run_greedy(runner, make_prompts(384), chunk_size=20) == hf_outputs[arch]
    assert run_greedy(runner, make_prompts(384), chunk_size=6, stagger=True, seed=1) == hf_outputs[arch]


def test_sharded_checkpoint_loads(tmp_path, hf_outputs: dict[str, list[list[int]]]) -> None:
    path = make_tiny_checkpoint("llama", tmp_path / "sharded", shard=True)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    runner = ModelRunner(engine_config(path))
    assert run_greedy(runner, make_prompts(384)) == hf_outputs["llama"]


def test_bfloat16_checkpoint_with_dtype_auto(tmp_path) -> None:
    path = make_tiny_checkpoint("qwen2", tmp_path / "bf16", dtype=torch.bfloat16)
    auto = engine_config(path)
    # "auto" follows the checkpoint, except that CPUs without native bf16 compute in float32.
    from pdcluster.config import cpu_has_fast_half_precision

    expect = "bfloat16" if cpu_has_fast_half_precision() else "float32"
    assert auto.model.dtype == expect and auto.cache.kv_cache_dtype == expect
    assert (auto.model.requested_dtype or auto.model.dtype) == "bfloat16"
    config = engine_config(path, compute_dtype="bfloat16")  # bf16 arithmetic must work everywhere
    assert config.model.dtype == "bfloat16" and config.cache.kv_cache_dtype == "bfloat16"
    runner = ModelRunner(config)
    assert runner.kv_caches.dtype == torch.bfloat16
    assert next(runner.model.parameters()).dtype == torch.bfloat16
    got = run_greedy(runner, make_prompts(384, lens=(9, 4)), max_tokens=8)
    assert [len(t) for t in got] == [8, 8]
    assert all(0 <= t < 384 for toks in got for t in toks)


def test_prefix_cache_hit_and_preemption_resume(checkpoints: dict[str, str],
                                                hf_outputs: dict[str, list[list[int]]]) -> None:
    """The two ways a NewRequestData starts mid-sequence: its first blocks already hold KV (prefix
    cache hit), or it was preempted and comes back with outputs to recompute."""
    runner = ModelRunner(engine_config(checkpoints["llama"], block_size=5))
    prompt, want = make_prompts(384)[2], hf_outputs["llama"][2]  # 33 prompt tokens
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    blocks_a = list(range(7))
    out = runner.execute(SchedulerOutput([NewRequestData("a", prompt, [], sp, blocks_a, 0)], [], {"a": 33}, 33))
    assert out.sampled_token_ids == [[want[0]]]
    # Same prompt: six full blocks (30 tokens) are shared with "a", only 3 tokens are computed.
    blocks_b = blocks_a[:6] + [10, 11]
    out = runner.execute(SchedulerOutput([NewRequestData("b", prompt, [], sp, blocks_b, 30)], [], {"b": 3}, 3, {"a"}))
    assert out.sampled_token_ids == [[want[0]]]
    # Preempted after 5 outputs: everything is recomputed, then decoding continues.
    blocks_c = list(range(20, 29))
    so = SchedulerOutput([NewRequestData("c", prompt, want[:5], sp, blocks_c, 0)], [], {"c": 38}, 38, {"b"})
    assert runner.execute(so).sampled_token_ids == [[want[5]]]
    for i in range(6, 10):
        so = SchedulerOutput([], [CachedRequestData("c", [], 33 + i - 1)], {"c": 1}, 1)
        assert runner.execute(so).sampled_token_ids == [[want[i]]]
