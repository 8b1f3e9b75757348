"""A compiled engine beside one busy process: LLM.generate() wall with the thread tuner and without.

    .venv/bin/python benchmarks/contention_generate.py

6 requests x (256 in, 16 out) on the 125M bench model (bf16, compiled, PDCLUSTER_COMPILE_START=wait),
3 interleaved rounds per mode, one `while True: pass` process beside it for the whole run (stopped
by pid). Prints each round's wall, the median ratio untuned / tuned, and whether each round's
tokens equal the first round's (later rounds hit the prefix cache, so their steps differ).
"""
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, "benchmarks")
os.environ["PDCLUSTER_COMPILE"] = "1"
os.environ["PDCLUSTER_COMPILE_START"] = "wait"
import torch
from bench_model import ensure_bench_model

from pdcluster import LLM, SamplingParams


def main() -> None:
    model = ensure_bench_model("/tmp/pdcluster-bench/llama-125m")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 30000, (256,), generator=g).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(model, compute_dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=256)
    runner = llm.engine.core.runner
    tuner = runner.thread_tuner
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        res = {"tuned": [], "untuned": []}
        outs = {}
        for rnd in range(3):
            for mode in ("untuned", "tuned"):
                runner.thread_tuner = tuner if mode == "tuned" else None
                torch.set_num_threads(2)
                t = time.perf_counter()
                o = llm.generate(prompts, params)
                res[mode].append(time.perf_counter() - t)
                toks = [list(x.outputs[0].token_ids) for x in o]
                outs.setdefault("first", toks)
                print(rnd, mode, "== first run:", toks == outs["first"], [i for i, (p, q) in enumerate(zip(toks, outs["first"])) if p != q], flush=True)
                outs[mode] = toks
        print({k: [round(x, 2) for x in v] for k, v in res.items()}, "median untuned/tuned",
              round(statistics.median(res["untuned"]) / statistics.median(res["tuned"]), 2))
        print("same tokens:", outs["tuned"] == outs["untuned"], "status:", runner.compile_status())
    finally:
        burner.kill()
        burner.wait()
        llm.shutdown()


if __name__ == "__main__":
    main()
