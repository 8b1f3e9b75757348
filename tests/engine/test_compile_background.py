"""Background compilation (engine/compiled_forward.py, PDCLUSTER_COMPILE_START=background): the
engine serves eagerly, token for token as an eager engine, while the compile thread runs; it
switches to the compiled layers between steps once the warm-up succeeded; a compile failure leaves
it eager and working; shutting down (and exiting) while compiling does not hang. PDCLUSTER_COMPILE=1
compiles the tiny models (below the auto threshold). Waits are on events with generous deadlines."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from pdcluster import LLM, SamplingParams
from pdcluster.engine.compiled_forward import CompiledForward, compile_start_policy

DEADLINE_S = 900  # a loaded 2-core machine; a compile of the tiny model takes 10-60 s


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in (1, 5, 17, 40, 9)]


def _generate(llm: LLM) -> list[list[int]]:
    prompts = _prompts(llm.engine.config.model.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (7, 12, 3, 9, 5)]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def _llm(model: str, **kw) -> LLM:
    return LLM(model, max_num_seqs=3, max_num_batched_tokens=32, num_kv_blocks=64, block_size=8, **kw)


@pytest.fixture
def background(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_COMPILE", "1")
    monkeypatch.setenv("PDCLUSTER_COMPILE_START", "background")
    # No thread tuner: its timing-driven eager steps would make the compiled-step counts below
    # depend on the machine's speed (test_thread_tuner.py covers the tuner with compiled layers).
    monkeypatch.setenv("PDCLUSTER_ADAPTIVE_THREADS", "0")


@pytest.fixture
def gated_warm_up(monkeypatch: pytest.MonkeyPatch):
    """The compile thread blocks before its warm-up until the test sets the returned event. At
    teardown a still-waiting thread is cancelled (its compile fails): a compile left running would
    trace, and take the cores, while later tests run."""
    gate, done = threading.Event(), threading.Event()
    real = CompiledForward.warm_up

    def warm_up(self: CompiledForward) -> None:
        gate.wait()
        if done.is_set():
            raise RuntimeError("cancelled by the test")
        real(self)

    monkeypatch.setattr(CompiledForward, "warm_up", warm_up)
    yield gate
    done.set()
    gate.set()


def test_start_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCLUSTER_COMPILE_START", raising=False)
    assert compile_start_policy() == "background"
    monkeypatch.setenv("PDCLUSTER_COMPILE_START", "wait")
    assert compile_start_policy() == "wait"
    monkeypatch.setenv("PDCLUSTER_COMPILE_START", "later")
    with pytest.raises(ValueError, match="PDCLUSTER_COMPILE_START"):
        compile_start_policy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_while_compiling_equals_eager_even_inside_a_compile_session(
        tmp_path, dtype: str, background, gated_warm_up, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.compiler.is_compiling() is True on every thread while a compile session is open (a
    # module global): the eager steps must not take the traced paths (attention op; in bfloat16,
    # where this CPU packs, the packed_linear op and the LM head's F.linear on its plain weight).
    from tiny_models import make_tiny_checkpoint

    model = make_tiny_checkpoint("llama", tmp_path / "llama", dtype=getattr(torch, dtype))
    eager = _llm(model, enforce_eager=True, compute_dtype=dtype)
    expected = _generate(eager)
    eager.shutdown()
    llm = _llm(model, compute_dtype=dtype)
    runner = llm.engine.core.runner
    assert isinstance(runner.forward_fn, CompiledForward)
    assert runner.compile_status()["state"] == "compiling"
    assert _generate(llm) == expected
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling()
    assert _generate(llm) == expected
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)
    assert runner.forward_fn.compiled_steps == 0 and runner.compile_status()["state"] == "compiling"
    llm.shutdown()


def test_compile_failure_stays_eager(tiny_ckpts, background, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self: CompiledForward) -> None:
        raise RuntimeError("injected compiler failure")

    monkeypatch.setattr(CompiledForward, "warm_up", fail)
    model = tiny_ckpts("llama")
    eager = _llm(model, enforce_eager=True)
    expected = _generate(eager)
    eager.shutdown()
    llm = _llm(model)
    forward = llm.engine.core.runner.forward_fn
    assert forward.compile_done.wait(DEADLINE_S)
    assert forward.state == "failed" and "injected" in forward.error
    assert _generate(llm) == expected  # the first step after the failure settles it: still eager
    status = llm.engine.core.runner.compile_status()
    assert status["state"] == "failed" and status["compiled_steps"] == 0
    assert _generate(llm) == expected
    llm.shutdown()


def test_enforce_eager_never_compiles(tiny_ckpts, background) -> None:
    llm = _llm(tiny_ckpts("llama"), enforce_eager=True)
    runner = llm.engine.core.runner
    assert runner.forward_fn is runner.model and runner.compile_status() == {"state": "eager"}
    llm.shutdown()


_EXIT_WHILE_COMPILING = r"""
import os, sys, threading, time
from pdcluster import LLM, SamplingParams
from pdcluster.engine.compiled_forward import CompiledForward
if sys.argv[2] == "block":  # a compile that never ends
    CompiledForward.warm_up = lambda self: threading.Event().wait()
llm = LLM(sys.argv[1], max_num_seqs=2, num_kv_blocks=32, block_size=8)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
state = llm.engine.core.runner.compile_status()["state"]
t0 = time.perf_counter()
llm.shutdown()
print("STATE", state, "SHUTDOWN_S", round(time.perf_counter() - t0, 2), "TOKENS", len(out[0].outputs[0].token_ids))
"""


def _exit_while_compiling(model: str, mode: str) -> str:
    env = {**os.environ, "PDCLUSTER_COMPILE": "1", "PDCLUSTER_COMPILE_START": "background"}
    proc = subprocess.run([sys.executable, "-c", _EXIT_WHILE_COMPILING, model, mode], env=env,
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_shutdown_and_exit_while_compiling_do_not_hang(tiny_ckpts) -> None:
    out = _exit_while_compiling(tiny_ckpts("llama"), "block")
    assert "STATE compiling" in out and "TOKENS 3" in out


@pytest.mark.slow  # a real compile (~20-60 s on a loaded 2-core machine)
def test_exit_during_a_real_compile(tiny_ckpts) -> None:
    out = _exit_while_compiling(tiny_ckpts("llama"), "real")
    assert "TOKENS 3" in out  # and the process exited cleanly (rc 0) whatever the compile was doing


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.slow  # compiles (~30-60 s on a loaded 2-core machine)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_background_compile_switches_and_equals_eager(tmp_path, dtype: str, background, gated_warm_up) -> None:
    from tiny_models import make_tiny_checkpoint

    # bfloat16: packed (oneDNN) linears where this CPU packs, the LM head's plain weight kept
    # until the switch.
    model = make_tiny_checkpoint("llama", tmp_path / "llama", dtype=getattr(torch, dtype))
    eager = _llm(model, enforce_eager=True, compute_dtype=dtype)
    expected = _generate(eager)
    eager.shutdown()
    llm = _llm(model, compute_dtype=dtype)
    forward = llm.engine.core.runner.forward_fn
    assert isinstance(forward, CompiledForward)
    # Gated: the first steps run before the compile could have finished.
    assert _generate(llm) == expected and forward.compiled_steps == 0
    gated_warm_up.set()
    # While the compile runs (tracing on the other thread) every step is eager and still equal.
    while not forward.compile_done.is_set():
        assert _generate(llm) == expected
    assert forward.compile_done.wait(DEADLINE_S) and forward.state in ("ready", "compiled"), forward.error
    graphs = _graphs()
    assert _generate(llm) == expected
    status = llm.engine.core.runner.compile_status()
    assert status["state"] == "compiled" and status["compile_seconds"] > 0
    assert forward.compiled_steps > 1  # the warm-up, then the steps with prefill tokens
    assert _generate(llm) == expected
    assert _graphs() == graphs  # the switch compiled nothing more
    llm.shutdown()
