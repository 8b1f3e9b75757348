"""Where an engine step's time goes in steady decode: the whole LLMEngine.step (scheduler, model
runner, output processing with detokenization), split by timers around its parts, so the share of
per-step Python beside the model's kernels is a printed figure, not a guess.

    python benchmarks/step_breakdown.py                 # bench Llama 125M, 1 request, 256 in
    python benchmarks/step_breakdown.py --batch 8 --steps 48
    python benchmarks/step_breakdown.py --batch 32 --kv-cache-dtype bfloat16
    PDCLUSTER_CPU_DECODE_STEP=0 python benchmarks/step_breakdown.py    # the eager layers

Parts (ms per step, medians over the decode-only steps; wall clock, so a part includes what the
machine stole from it):
  schedule     Scheduler.schedule
  inputs       ModelRunner.prepare_inputs (ids, positions, attention metadata)
  layers       the decoder layers: the one-call driver's C call (kernels/decode_step_cpu.run), or
               the whole forward (embedding, eager layers, final norm) when it is off
  lm_head      compute_logits (the LM head product and the float32 logits)
  sample       the Sampler call (greedy here: the argmax over the vocabulary; PDCLUSTER_CPU_ARGMAX=0
               for torch.argmax instead of kernels/argmax_cpu.py)
  runner_rest  the rest of ModelRunner.execute: embedding, runner bookkeeping
  update       Scheduler.update (appending tokens, stop checks, freeing)
  output       OutputProcessor.process (detokenization, RequestOutputs)
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_model import ensure_bench_model  # noqa: E402

os.environ.setdefault("PDCLUSTER_COMPILE_START", "wait")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=os.path.expanduser("~/.cache/pdcluster/bench-llama-125m"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--kv-cache-dtype", default="auto", help="as the engine's --kv-cache-dtype")
    args = parser.parse_args()
    import torch

    from pdcluster.config import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.kernels import decode_step_cpu
    from pdcluster.sampling_params import SamplingParams

    model = ensure_bench_model(args.model_dir)
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, device="cpu", kv_cache_dtype=args.kv_cache_dtype))
    core, runner = engine.core, engine.core.runner
    part: dict[str, float] = collections.defaultdict(float)

    def timed(obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                part[key] += time.perf_counter() - t0
        setattr(obj, name, wrapper)

    timed(core.scheduler, "schedule", "schedule")
    timed(core.scheduler, "update", "update")
    timed(runner, "execute", "runner")
    timed(runner, "prepare_inputs", "inputs")
    timed(runner.model, "compute_logits", "lm_head")
    timed(engine.output_processor, "process", "output")
    timed(decode_step_cpu, "run", "layers_driver")
    timed(runner, "forward_fn", "forward")  # embedding + layers + final norm (the eager layers' time)
    sampler = runner._get_sampler()

    def sample(*a, **k):
        t0 = time.perf_counter()
        try:
            return sampler(*a, **k)
        finally:
            part["sample"] += time.perf_counter() - t0
    runner._get_sampler = lambda: sample

    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True)
    for j in range(args.batch):
        engine.add_request([3 + (i * 7919 + j * 131) % 30000 for i in range(args.prompt_len)], params)
    rows: list[dict[str, float]] = []
    while engine.has_unfinished_requests():
        part.clear()
        decode = runner.requests and all(r.num_computed_tokens >= r.num_prompt_tokens
                                         for r in runner.requests.values())
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        if decode and len(runner.requests) == args.batch:
            layers = part["layers_driver"] or part["forward"]
            rows.append({"total": total, "schedule": part["schedule"], "inputs": part["inputs"], "layers": layers,
                         "lm_head": part["lm_head"], "sample": part["sample"],
                         "runner_rest": part["runner"] - part["inputs"] - layers - part["lm_head"] - part["sample"],
                         "update": part["update"], "output": part["output"]})
    rows = rows[2:] or rows
    med = {k: 1e3 * statistics.median(r[k] for r in rows) for k in rows[0]}
    driver = runner.model.model.decode_step.steps
    print(f"batch={args.batch} prompt={args.prompt_len} decode steps={len(rows)} threads={torch.get_num_threads()} "
          f"decode driver={'on' if driver else 'off'} kv={engine.config.cache.kv_cache_dtype} load={os.getloadavg()[0]:.1f}")
    for k, v in med.items():
        share = "" if k == "total" else f"  {100 * v / med['total']:5.1f}%"
        print(f"  {k:12s} {v:7.2f} ms{share}")
    python = med["total"] - med["layers"] - med["lm_head"]
    print(f"  outside the model's kernels (schedule, inputs, runner rest, update, output): {python:.2f} ms, "
          f"{100 * python / med['total']:.1f}% of the step")
    engine.shutdown()


if __name__ == "__main__":
    main()
