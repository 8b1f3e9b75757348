"""Offline throughput: pdcluster vs transformers (vs vLLM's CPU build when a venv with it exists),
side by side in one run, on the same random-weight model and the same requests.

    python benchmarks/throughput.py                       # fixed: 32 x (256 in, 128 out)
    python benchmarks/throughput.py --workload ragged     # prompts 16..512, outputs 16..256
    python benchmarks/throughput.py --vllm-python /path/to/vllm-venv/bin/python

Reports generated and total (prompt + generated) tokens/s, median of --repeats runs each.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_model import ensure_bench_model  # noqa: E402


def make_workload(kind: str, n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    if kind == "fixed":
        lens, outs = [256] * n, [128] * n
    else:
        lens = [rng.randint(16, 512) for _ in range(n)]
        outs = [rng.randint(16, 256) for _ in range(n)]
    return [[rng.randrange(3, vocab) for _ in range(m)] for m in lens], outs


def run_pdcluster(model: str, prompts, outs, repeats: int, tp: int, extra: dict) -> list[float]:
    from pdcluster import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", max_model_len=1024, tensor_parallel_size=tp, **extra)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outs]
    llm.generate(prompts[:2], params[:2])  # warm-up
    times = []
    for _ in range(repeats):
        llm.engine.core.scheduler.reset_prefix_cache()  # measure compute, not cache hits
        t0 = time.perf_counter()
        res = llm.generate(prompts, params)
        times.append(time.perf_counter() - t0)
        assert [len(r.outputs[0].token_ids) for r in res] == outs
    return times


def run_transformers(model: str, prompts, outs, repeats: int, batch: int) -> list[float]:
    """Static batches of `batch` requests (left-padded); each batch generates its longest output."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            ps, os_ = prompts[i:i + batch], outs[i:i + batch]
            width = max(map(len, ps))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
            with torch.no_grad():
                m.generate(ids, attention_mask=mask, max_new_tokens=max(os_), min_new_tokens=max(os_),
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        times.append(time.perf_counter() - t0)
    return times


def run_vllm(python: str, model: str, prompts, outs, repeats: int) -> list[float]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "max_tokens": outs, "repeats": repeats}, f)
    script = pathlib.Path(__file__).resolve().parent / "_vllm_throughput.py"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_LOGGING_LEVEL="WARNING")
    # -P: keep benchmarks/ off sys.path (vLLM imports a top-level `kernels` module of its own).
    proc = subprocess.run([python, "-P", str(script), model, f.name], capture_output=True, text=True, env=env)
    os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["times"]
    raise RuntimeError(f"vLLM run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/pdcluster/bench-llama-125m"))
    ap.add_argument("--workload", choices=["fixed", "ragged"], default="fixed")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--also-bf16-compute", action="store_true",
                    help="also run pdcluster forced to bfloat16 arithmetic (compute_dtype=bfloat16)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["pdcluster", "transformers", "vllm"])
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    model = ensure_bench_model(args.model_dir)
    prompts, outs = make_workload(args.workload, args.num_requests, 32000)
    total = sum(map(len, prompts)) + sum(outs)
    gen = sum(outs)
    results: dict[str, list[float]] = {}
    if "pdcluster" not in args.skip:
        # compute_dtype "auto": float32 arithmetic on CPUs without native bf16 (bf16 weights widened).
        results["pdcluster"] = run_pdcluster(model, prompts, outs, args.repeats, args.tp, {})
        if args.also_bf16_compute:
            results["pdcluster-bf16"] = run_pdcluster(model, prompts, outs, args.repeats, args.tp,
                                                      {"compute_dtype": "bfloat16"})
    if "transformers" not in args.skip:
        results["transformers"] = run_transformers(model, prompts, outs, args.repeats, batch=32)
    if "vllm" not in args.skip and os.path.exists(args.vllm_python):
        results["vllm-cpu"] = run_vllm(args.vllm_python, model, prompts, outs, args.repeats)
    print(f"workload={args.workload} requests={len(prompts)} prompt_tokens={sum(map(len, prompts))} "
          f"generated={gen} threads={os.cpu_count()}")
    print(f"{'engine':<14}{'median s':>10}{'gen tok/s':>12}{'total tok/s':>13}")
    summary = {}
    for name, ts in results.items():
        med = statistics.median(ts)
        summary[name] = {"times": ts, "median_s": med, "gen_tok_s": gen / med, "total_tok_s": total / med}
        print(f"{name:<14}{med:>10.2f}{gen / med:>12.1f}{total / med:>13.1f}")
    if "pdcluster" in summary:
        for other in ("transformers", "vllm-cpu"):
            if other in summary:
                print(f"pdcluster / {other}: {summary['pdcluster']['total_tok_s'] / summary[other]['total_tok_s']:.2f}x")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
