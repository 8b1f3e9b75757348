"""The one-call decode step (models/cpu_decode_step.py, kernels/csrc/decode_step_cpu.c) against
the eager layers it replaces: the same final hidden states and the same KV cache writes, bit for
bit, over several steps, batch sizes, caches and layer kinds; and the models and steps it must
leave to the eager layers."""

from __future__ import annotations

import pytest
import torch
from models.tiny_archs import make_checkpoint
from tiny_models import make_tiny_checkpoint

from pdcluster.config import EngineArgs
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pdcluster.kernels import decode_step_cpu, gemv_bf16_cpu
from pdcluster.models import cpu_decode_step
from pdcluster.models.layers import cpu_gemv
from pdcluster.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not decode_step_cpu.available(), reason="no C compiler on this machine")

BLOCK = 4


def _runner(path: str, kv_dtype: str = "auto", num_kv_blocks: int = 96, compute: str = "float32",
            **overrides) -> ModelRunner:
    cfg = EngineArgs(model=path, compute_dtype=compute, block_size=BLOCK, num_kv_blocks=num_kv_blocks,
                     max_model_len=128,
                     device="cpu", enforce_eager=True, kv_cache_dtype=kv_dtype, **overrides).create_engine_config()
    return ModelRunner(cfg)


def _prefill(runner: ModelRunner, lens: list[int], vocab: int, per: int = 24) -> None:
    g = torch.Generator().manual_seed(sum(lens))
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    new, sched, first = [], {}, 0
    for i, n in enumerate(lens):
        prompt = torch.randint(3, vocab, (n,), generator=g).tolist()
        blocks = list(range(first, first + per))  # room for the prompt and every decode step
        first += per
        new.append(NewRequestData(f"r{i}", prompt, [], params, blocks, 0))
        sched[f"r{i}"] = n
    runner.execute(SchedulerOutput(new, [], sched, sum(lens)))


def _decode(runner: ModelRunner, ids: list[str]) -> SchedulerOutput:
    cached = [CachedRequestData(r, [], runner.requests[r].num_computed_tokens) for r in ids]
    return SchedulerOutput([], cached, {r: 1 for r in ids}, len(ids))


def _eager(decoder, monkeypatch, *args) -> torch.Tensor:
    """The eager layers on the same inputs: a fresh DecodeStep with the switch off refuses."""
    saved = decoder.decode_step
    with monkeypatch.context() as m:
        m.setenv(cpu_decode_step.ENV, "0")
        decoder.decode_step = cpu_decode_step.DecodeStep()
        try:
            return decoder(*args)
        finally:
            decoder.decode_step = saved


CASES = [
    ("llama", "auto", {}),  # llama3 rope, GQA
    ("qwen2", "auto", {}),  # q/k/v bias, tied head
    ("qwen2", "bfloat16", {}),  # bf16 cache: the driver rounds K/V as .to(bfloat16) does
    ("mistral", "auto", {"sliding_window": 6}),  # windowed attention
    ("llama2", "bfloat16", {"attention_bias": True}),  # MHA, o_proj bias too
    ("llama", "auto", {"mlp_bias": True}),  # gate/up and down biases
    ("smollm3", "auto", {}),  # NoPE every other layer: those rotate nothing
    ("qwen3", "auto", {}),  # per-head q/k RMSNorm, head_dim 32 != hidden / heads
    ("qwen3", "bfloat16", {"sliding_window": 5, "use_sliding_window": True, "max_window_layers": 1}),
    ("phi3", "auto", {"sliding_window": 6}),  # 12 of 16 channels rotated, LongRoPE's short factors, a window
    ("granite", "auto", {}),  # block outputs scaled before the residual add; the softmax scale its own
]


@pytest.mark.parametrize(("arch", "kv_dtype", "cfg"), CASES, ids=[f"{a}-{k}-{len(c)}" for a, k, c in CASES])
# The last: as many rows as the decode copies serve (cpu_gemv.MAX_ROWS), of ragged lengths: every
# pass shape of the GEMV kernel (5 rows a pass, the last ones spread) in one step.
@pytest.mark.parametrize("lens", [[9], [5, 13, 2], [2 + (7 * i) % 11 for i in range(cpu_gemv.MAX_ROWS)]],
                         ids=["batch1", "batch3", "batch-max"])
def test_bit_for_bit_the_eager_step(tmp_path, monkeypatch, arch: str, kv_dtype: str, cfg: dict,
                                    lens: list[int]) -> None:
    _bit_for_bit(tmp_path, monkeypatch, arch, kv_dtype, cfg, lens, "float32")


# A bfloat16 model (what compute_dtype "auto" runs on a CPU with BF16 instructions; bf16
# arithmetic works on any CPU): the driver's bf16 mode against the eager bf16 layers.
CASES_BF16 = [
    ("llama", {}),
    ("qwen2", {}),  # q/k/v bias (widened into the plan)
    ("llama2", {"attention_bias": True}),  # o_proj bias too
    ("llama", {"mlp_bias": True}),  # gate/up and down biases (widened into the plan)
    ("mistral", {"sliding_window": 6}),
    ("smollm3", {}),
    ("qwen3", {}),  # per-head q/k RMSNorm in bf16
    ("phi3", {}),  # partial rotary in bf16
    ("granite", {}),  # the residual multiplier's product rounded to bf16 again
]


_BF16_ROWS = cpu_gemv.max_rows(torch.bfloat16)  # MAX_ROWS, or 8 where oneDNN out-computes the kernel


@pytest.mark.parametrize(("arch", "cfg"), CASES_BF16, ids=[f"{a}-{len(c)}" for a, c in CASES_BF16])
@pytest.mark.parametrize("lens", [[9], [5, 13, 2], [2 + (7 * i) % 11 for i in range(_BF16_ROWS)]],
                         ids=["batch1", "batch3", "batch-max"])
def test_bit_for_bit_the_eager_bfloat16_step(tmp_path, monkeypatch, arch: str, cfg: dict, lens: list[int]) -> None:
    _bit_for_bit(tmp_path, monkeypatch, arch, "auto", cfg, lens, "bfloat16")


def _bit_for_bit(tmp_path, monkeypatch, arch: str, kv_dtype: str, cfg: dict, lens: list[int], compute: str) -> None:
    make = make_checkpoint if arch == "smollm3" else make_tiny_checkpoint
    path = make(arch, tmp_path / arch, dtype=torch.bfloat16, **cfg)
    assert len(lens) <= cpu_gemv.max_rows(getattr(torch, compute))
    runner = _runner(path, kv_dtype, num_kv_blocks=max(96, 6 * len(lens)), max_num_seqs=max(8, len(lens)),
                     compute=compute)
    assert runner.kv_caches.dtype == (torch.float32 if compute == "float32" and kv_dtype == "auto"
                                      else torch.bfloat16)
    decoder = runner.model.model
    # transformers initialises every RMSNorm weight to ones: distinct weights, so a norm applied
    # with another's weight (input vs post-attention, q vs k) cannot pass unseen.
    g = torch.Generator().manual_seed(5)
    for name, p in decoder.named_parameters():
        if "norm" in name:
            p.data.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    assert cpu_decode_step.why_not(decoder) is None
    _prefill(runner, lens, runner.config.model.vocab_size, per=6)  # 6 blocks: <= 12 prompt + 6 decode tokens
    _steps_match_eager(runner, monkeypatch, [f"r{i}" for i in range(len(lens))], compute)


def _steps_match_eager(runner: ModelRunner, monkeypatch, ids: list[str], compute: str) -> None:
    decoder = runner.model.model
    with torch.inference_mode():
        for _ in range(6):  # crosses block boundaries (BLOCK 4) and the window
            reqs = [runner.requests[r] for r in ids]
            input_ids, positions, meta = runner.prepare_inputs(reqs, [1] * len(ids))
            kv_fast, kv_eager = runner.kv_caches.clone(), runner.kv_caches.clone()
            before = decoder.decode_step.steps
            fast = decoder(input_ids, positions, kv_fast, meta)
            assert decoder.decode_step.steps == before + 1  # the driver ran, not the eager layers
            assert fast.dtype == getattr(torch, compute)
            eager = _eager(decoder, monkeypatch, input_ids, positions, kv_eager, meta)
            assert torch.equal(fast, eager)
            assert torch.equal(kv_fast, kv_eager)
            assert not torch.equal(kv_fast, runner.kv_caches)  # the step did write the new K/V
            runner.execute(_decode(runner, ids))  # advance (through the driver)


def test_copies_of_either_layout_run_their_kernel_and_mixed_layouts_are_refused(tmp_path, monkeypatch) -> None:
    """A bf16 model's copies are PAIRS where the dot-product kernel runs, TILES elsewhere: the
    driver calls the product of its copies' layout (so the other machine kind's path is checked
    here too, where it can run), bit for bit the eager step, and refuses a mix by name."""
    path = make_tiny_checkpoint("llama", tmp_path / "l", dtype=torch.bfloat16)
    runner = _runner(path, compute="bfloat16")
    decoder = runner.model.model
    linears = cpu_decode_step._linears(decoder)
    TILES, PAIRS = gemv_bf16_cpu.TILES, gemv_bf16_cpu.PAIRS
    default = linears[0].gemv_weight.layout
    assert default == (PAIRS if gemv_bf16_cpu.has_bf16_dot() else TILES)
    other = TILES if default == PAIRS else PAIRS
    linears[1].gemv_weight = gemv_bf16_cpu.pack(linears[1].gemv_weight.unpack(), other)
    assert "different layouts" in (cpu_decode_step.why_not(decoder) or "")
    if other == PAIRS and not gemv_bf16_cpu.has_bf16_dot():
        return  # the pair kernel cannot run on this CPU
    for lin in linears:
        lin.gemv_weight = gemv_bf16_cpu.pack(lin.gemv_weight.unpack(), other)
    assert cpu_decode_step.why_not(decoder) is None
    _prefill(runner, [5, 9, 2], runner.config.model.vocab_size, per=6)
    _steps_match_eager(runner, monkeypatch, ["r0", "r1", "r2"], "bfloat16")


def test_pair_copies_under_a_float32_model_are_refused(tmp_path) -> None:
    """The pair kernel takes rows of bf16 values, which a float32 model's activations are not."""
    runner = _runner(make_tiny_checkpoint("llama", tmp_path / "l", dtype=torch.bfloat16))  # float32 compute
    decoder = runner.model.model
    for lin in cpu_decode_step._linears(decoder):
        lin.gemv_weight = gemv_bf16_cpu.pack(lin.gemv_weight.unpack(), gemv_bf16_cpu.PAIRS)  # plain weights are released
    assert "float32 model" in (cpu_decode_step.why_not(decoder) or "")


def test_steps_it_does_not_take_run_the_eager_layers(tmp_path) -> None:
    path = make_tiny_checkpoint("llama", tmp_path / "l", dtype=torch.bfloat16)
    runner = _runner(path)
    decoder = runner.model.model
    _prefill(runner, [7, 3], runner.config.model.vocab_size)  # a prefill step: eager
    assert decoder.decode_step.steps == 0
    runner.execute(_decode(runner, ["r0", "r1"]))
    assert decoder.decode_step.steps == 1
    # More requests than the decode copies serve rows (cpu_gemv.MAX_ROWS): eager.
    n = cpu_gemv.MAX_ROWS + 1
    wide = _runner(path, num_kv_blocks=5 * n, max_num_seqs=2 * n)
    _prefill(wide, [7] * n, wide.config.model.vocab_size, per=4)
    wide.execute(_decode(wide, [f"r{i}" for i in range(n)]))
    assert wide.model.model.decode_step.steps == 0
    wide.execute(_decode(wide, [f"r{i}" for i in range(cpu_gemv.MAX_ROWS)]))  # at the limit: taken
    assert wide.model.model.decode_step.steps == 1


def test_a_native_bf16_cpu_takes_bfloat16_steps_only_up_to_its_limit(tmp_path, monkeypatch) -> None:
    """Where oneDNN's bf16 products out-compute the kernel (cpu_gemv.MAX_ROWS_NATIVE_BF16), a
    bigger bf16 decode step runs the eager layers (oneDNN's products), a step at the limit the driver."""
    monkeypatch.setattr(cpu_gemv, "_bf16_rows", lambda: cpu_gemv.MAX_ROWS_NATIVE_BF16)
    n = cpu_gemv.MAX_ROWS_NATIVE_BF16 + 1
    path = make_tiny_checkpoint("llama", tmp_path / "l", dtype=torch.bfloat16)
    runner = _runner(path, num_kv_blocks=5 * n, max_num_seqs=2 * n, compute="bfloat16")
    _prefill(runner, [7] * n, runner.config.model.vocab_size, per=4)
    runner.execute(_decode(runner, [f"r{i}" for i in range(n)]))
    assert runner.model.model.decode_step.steps == 0
    runner.execute(_decode(runner, [f"r{i}" for i in range(n - 1)]))  # at the limit: taken
    assert runner.model.model.decode_step.steps == 1


@pytest.mark.parametrize(("arch", "dtype", "why"), [
    ("llama", torch.float32, "no bf16 decode copy"),  # float32 values: no bf16 copies to read
    ("mixtral", torch.bfloat16, "not a dense gated MLP"),  # MoE
])
def test_models_it_does_not_know_are_refused_by_name(tmp_path, arch: str, dtype: torch.dtype, why: str) -> None:
    make = make_checkpoint if arch == "mixtral" else make_tiny_checkpoint
    runner = _runner(make(arch, tmp_path / arch, dtype=dtype))
    decoder = runner.model.model
    assert why in (cpu_decode_step.why_not(decoder) or "")
    _prefill(runner, [6], runner.config.model.vocab_size)
    runner.execute(_decode(runner, ["r0"]))
    assert decoder.decode_step.steps == 0


def test_the_switch_turns_it_off(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(cpu_decode_step.ENV, "0")
    runner = _runner(make_tiny_checkpoint("llama", tmp_path / "l", dtype=torch.bfloat16))
    assert cpu_decode_step.why_not(runner.model.model) == f"{cpu_decode_step.ENV}=0"
    _prefill(runner, [6], runner.config.model.vocab_size)
    runner.execute(_decode(runner, ["r0"]))
    assert runner.model.model.decode_step.steps == 0


def test_a_kernel_refusal_hands_the_step_to_the_eager_layers(tmp_path) -> None:
    """A position past the rope table: the driver's rotary call refuses (before it writes) and the
    eager layers take the step, raising the IndexError they always raised."""
    runner = _runner(make_tiny_checkpoint("llama", tmp_path / "l", dtype=torch.bfloat16))
    decoder = runner.model.model
    _prefill(runner, [6], runner.config.model.vocab_size)
    reqs = [runner.requests["r0"]]
    with torch.inference_mode():
        input_ids, positions, meta = runner.prepare_inputs(reqs, [1])
        with pytest.raises(IndexError):
            decoder(input_ids, positions + 10_000, runner.kv_caches, meta)
        assert decoder.decode_step.steps == 0
        decoder(input_ids, positions, runner.kv_caches, meta)  # and the next good step takes it
    assert decoder.decode_step.steps == 1
