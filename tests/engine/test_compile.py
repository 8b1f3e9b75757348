"""torch.compile of the decoder forward (engine/compiled_forward.py): compiled output equals eager
token for token (float32) in every batch composition (chunked prefill, prefill over a cached
prefix, mixed prefill + decode steps; decode-only steps run eagerly), no recompiles after
start-up, and the cases that must stay eager do. The compile itself takes a while on a small
machine (25-60 s cold, ~30 s per test even warm from inductor's on-disk cache on a loaded 2-core
machine), so every compiling test is marked slow; the default suite checks which engines
compile."""

from __future__ import annotations

import pathlib

import pytest
import torch

from pdcluster import LLM, SamplingParams
from pdcluster.engine.compiled_forward import CompiledForward, compile_unsupported


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [1, 5, 17, 40, 9, 33, 2, 24][:n]
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def _run(model: str, *, eager: bool, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, enforce_eager=eager, max_num_seqs=3, max_num_batched_tokens=32, num_kv_blocks=64,
              block_size=8, **kw)
    prompts = _prompts(8, llm.engine.config.model.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (7, 12, 3, 9, 16, 5, 10, 6)]
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    # The same prompts again: prefix-cache hits, so prefills over a cached prefix.
    again = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[:4], params[:4])]
    return outs + again, llm


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.fixture
def compile_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_COMPILE", "1")  # the tiny models are below the auto threshold
    monkeypatch.setenv("PDCLUSTER_COMPILE_START", "wait")  # compiled from the first step (background: its own tests)
    # No thread tuner: from its step timings it may run steps with prefill tokens eagerly at fewer
    # threads, so how many steps the compiled layers take would depend on the machine's speed.
    monkeypatch.setenv("PDCLUSTER_ADAPTIVE_THREADS", "0")


def _check_equal(model: str, **kw) -> None:
    eager_out, eager_llm = _run(model, eager=True, **kw)
    assert eager_llm.engine.core.runner.forward_fn is eager_llm.engine.core.runner.model
    eager_llm.shutdown()
    graphs = _graphs()
    out, llm = _run(model, eager=False, **kw)
    compiled = llm.engine.core.runner.forward_fn
    assert isinstance(compiled, CompiledForward)
    assert compiled.compiled_steps > 4  # the warm-up, then the steps with prefill tokens
    llm.shutdown()
    assert out == eager_out
    # Warm-up compiled at most one graph per layer kind; the steps themselves compiled nothing.
    assert _graphs() - graphs <= 2


@pytest.mark.slow  # ~30 s on a loaded 2-core machine even with a warm cache
def test_one_layer_compiled_equals_eager(compile_on, tmp_path: pathlib.Path) -> None:
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama2", tmp_path / "one-layer", num_hidden_layers=1)
    _check_equal(path)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_compiled_equals_eager_per_arch(arch: str, compile_on, tmp_path: pathlib.Path) -> None:
    from tiny_models import make_tiny_checkpoint

    # mistral/qwen2 with a window shorter than the prompts: the windowed path under the op too.
    overrides = {"sliding_window": 8} if arch == "mistral" else {}
    _check_equal(make_tiny_checkpoint(arch, tmp_path / arch, **overrides))


@pytest.mark.slow
def test_compiled_equals_eager_fp8_kv(tiny_ckpts, compile_on) -> None:
    _check_equal(tiny_ckpts("llama"), kv_cache_dtype="fp8")


def test_enforce_eager_and_unsupported_stay_eager(tiny_ckpts, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(tiny_ckpts("llama"), enforce_eager=True, num_kv_blocks=16)
    runner = llm.engine.core.runner
    assert runner.forward_fn is runner.model and llm.engine.config.enforce_eager
    config = runner.config
    assert compile_unsupported(config, runner.model, "1") == "enforce_eager"
    llm.shutdown()
    llm = LLM(tiny_ckpts("llama"), num_kv_blocks=16)  # auto: a tiny model does not repay a compile
    runner = llm.engine.core.runner
    assert runner.forward_fn is runner.model
    assert "parameters" in compile_unsupported(runner.config, runner.model, "auto")
    assert compile_unsupported(runner.config, runner.model, "0") == "PDCLUSTER_COMPILE=0"
    assert compile_unsupported(runner.config, runner.model, "1") is None
    with pytest.raises(ValueError, match="PDCLUSTER_COMPILE"):
        compile_unsupported(runner.config, runner.model, "yes")
    llm.shutdown()


def test_serve_worker_enforce_eager_reaches_the_engine() -> None:
    from pdcluster.cluster.cli import build_parser
    from pdcluster.cluster.worker_cmd import worker_config

    parser = build_parser()
    assert worker_config(parser.parse_args(["serve-worker", "--enforce-eager"])).engine["enforce_eager"] is True
    assert worker_config(parser.parse_args(["serve-worker"])).engine["enforce_eager"] is False
