"""Batch-B decode steps with the one-call decode driver (models/cpu_decode_step.py) against the
eager layers, in one process, interleaved: memory bandwidth on a shared VM moves within minutes,
so only rounds taken side by side compare.

    python benchmarks/decode_step.py                       # bench Llama 125M, batch 1, context 256
    python benchmarks/decode_step.py --batch 4 --rounds 10 --context 512
    python benchmarks/decode_step.py --compute-dtype bfloat16   # the bf16 driver (what a BF16 CPU runs)

Each round: --steps decode steps with the driver, then as many through the eager layers (the same
runner, weights and KV cache; every request's context reset to --context before each run of steps),
alternating which goes first. Printed: the median ms per step of each round, the medians over
rounds, the ratio, the thread count and the CPU flags.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="the engine's compute_dtype (auto: bfloat16 only on a CPU with bf16 instructions)")
    args = parser.parse_args()
    import torch

    from pdcluster.config import EngineArgs
    from pdcluster.engine.model_runner import ModelRunner
    from pdcluster.engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from pdcluster.models import cpu_decode_step
    from pdcluster.sampling_params import SamplingParams

    model = ensure_bench_model(args.model_dir)
    block = 16
    per = (args.context + args.steps) // block + 2
    cfg = EngineArgs(model=model, compute_dtype=args.compute_dtype, block_size=block, num_kv_blocks=per * args.batch + 1,
                     max_model_len=args.context + args.steps + 1, device="cpu").create_engine_config()
    runner = ModelRunner(cfg)
    decoder = runner.model.model
    why = cpu_decode_step.why_not(decoder)
    if why is not None:
        raise SystemExit(f"the decode driver does not take this model: {why}")
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True)
    ids = [f"r{i}" for i in range(args.batch)]
    new = [NewRequestData(r, [3 + (i * 7919 + j) % 30000 for i in range(args.context)], [], params,
                          list(range(j * per, (j + 1) * per)), 0) for j, r in enumerate(ids)]
    runner.execute(SchedulerOutput(new, [], {r: args.context for r in ids}, args.context * args.batch))
    base = {r: list(runner.requests[r].token_ids) for r in ids}
    on, off = decoder.decode_step, cpu_decode_step.DecodeStep()
    off._refused = (cpu_decode_step._weights_key(cpu_decode_step._linears(decoder)), "benchmark: eager side")

    def steps() -> float:
        for r in ids:
            runner.requests[r].token_ids[:] = base[r]
            runner.requests[r].num_computed_tokens = args.context
        times = []
        for i in range(args.steps):
            so = SchedulerOutput([], [CachedRequestData(r, [], args.context + i) for r in ids], {r: 1 for r in ids},
                                 len(ids))
            t0 = time.perf_counter()
            runner.execute(so)
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    res: dict[str, list[float]] = {"driver": [], "eager": []}
    with torch.inference_mode():
        steps()  # warm-up: builds the plan, settles the thread tuner
        for r in range(args.rounds):
            order = [("driver", on), ("eager", off)] if r % 2 == 0 else [("eager", off), ("driver", on)]
            for name, step in order:
                decoder.decode_step = step
                res[name].append(steps())
        decoder.decode_step = on
    flags = open("/proc/cpuinfo").read()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    print(f"batch={args.batch} context={args.context} compute_dtype={cfg.model.dtype} "
          f"threads={torch.get_num_threads()} cpu_isa={','.join(isa)} "
          f"load={os.getloadavg()[0]:.1f}")
    for name, v in res.items():
        print(f"{name:7s} ms/step per round: " + " ".join(f"{x:.2f}" for x in v) + f"  median {statistics.median(v):.2f}")
    print(f"eager / driver: {statistics.median(res['eager']) / statistics.median(res['driver']):.2f}x")


if __name__ == "__main__":
    main()
