"""Engine start-up: model load plus torch.compile, cold (empty inductor cache) and warm: eager,
compiled before serving (PDCLUSTER_COMPILE_START=wait) and compiled in the background (the default).
(benchmarks/startup.py measures the cluster's start-up on Ray; this is one engine's.)

    python benchmarks/engine_startup.py [--model demo|bench|PATH] [--runs 1] [--modes eager wait background]
                                        [--out FILE]

Each measurement is a fresh Python process: import pdcluster, build `LLM(model)` (weights loaded,
KV cache allocated; under wait the layers compiled by a warm-up step, under background the compile
thread started), then one greedy token: "usable" is the sum. Then, for the compiling modes, the
time from the process start until the compile finished ("compiled at"), and the batch-1 decode
ms/token after it (32 tokens; the switch happens at the first of those steps). Reported per phase:
wall seconds and CPU seconds of the process and its children (inductor runs gcc in children), so a
loaded machine's figures can still be compared. "cold" runs with an empty TORCHINDUCTOR_CACHE_DIR,
"warm" with the cache the cold run filled. Compiling runs set PDCLUSTER_COMPILE=1 (the demo model
is below the auto threshold); eager ones --enforce-eager.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, resource, sys, time
def cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
marks = [("start", time.perf_counter(), cpu())]
from pdcluster import LLM, SamplingParams
marks.append(("import", time.perf_counter(), cpu()))
llm = LLM(sys.argv[1], enforce_eager=sys.argv[2] == "eager", max_model_len=512)
marks.append(("load+compile", time.perf_counter(), cpu()))
llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=1))
marks.append(("first token", time.perf_counter(), cpu()))
out = {name: [round(t - pt, 2), round(c - pc, 2)] for (name, t, c), (_, pt, pc) in zip(marks[1:], marks)}
forward = llm.engine.core.runner.forward_fn
if hasattr(forward, "compile_done"):
    forward.compile_done.wait(3600)
    out["compiled at"] = [round(time.perf_counter() - marks[0][1], 2), round(cpu() - marks[0][2], 2)]
prompt = [5, 6, 7, 8] * 16
def gen(n):
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - t0
gen(2)  # the switch, if any, happens here
one, many = gen(1), gen(33)
out["decode ms/token"] = round(1e3 * (many - one) / 32, 1)
out["status"] = llm.engine.core.runner.compile_status()
out["load"] = round(os.getloadavg()[0], 2)
print(json.dumps(out))
"""
MODE_ENV = {"eager": {"PDCLUSTER_COMPILE": "0"},
            "wait": {"PDCLUSTER_COMPILE": "1", "PDCLUSTER_COMPILE_START": "wait"},
            "background": {"PDCLUSTER_COMPILE": "1", "PDCLUSTER_COMPILE_START": "background"}}


def resolve_model(name: str) -> str:
    if name == "demo":
        from pdcluster.models.demo import ensure_demo_model

        return ensure_demo_model()
    if name == "bench":
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from bench_model import ensure_bench_model

        return ensure_bench_model(os.path.expanduser("~/.cache/pdcluster/bench-llama-125m"))
    return name


def run_once(model: str, mode: str, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, **MODE_ENV[mode]}
    out = subprocess.run([sys.executable, "-c", CHILD, model, mode], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="demo, bench (125M Llama) or a checkpoint path")
    ap.add_argument("--runs", type=int, default=1, help="cold+warm pairs per mode (medians printed)")
    ap.add_argument("--modes", nargs="+", default=list(MODE_ENV), choices=list(MODE_ENV))
    ap.add_argument("--out", default=None, help="write the runs as JSON here")
    args = ap.parse_args()
    model = resolve_model(args.model)
    rows: dict[str, list[dict]] = {}
    loads = [os.getloadavg()[0]]
    for _ in range(args.runs):
        for mode in args.modes:
            with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
                for state in ("cold", "warm"):
                    rows.setdefault(f"{mode} {state}", []).append(run_once(model, mode, cache))
                    loads.append(rows[f"{mode} {state}"][-1]["load"])
    print(f"model {args.model} ({model}); wall s / CPU s (process + children), median of {args.runs}; "
          f"load average (1 min) {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs")
    phases = ("import", "load+compile", "first token")
    print(f"{'':16s} " + " ".join(f"{h:>13s}" for h in (*phases, "usable", "compiled at"))
          + f" {'decode ms/tok':>13s}  state")
    for key, runs in rows.items():
        cells = [[statistics.median(r[phase][i] for r in runs) for i in (0, 1)] for phase in phases]
        cells.append([sum(c[i] for c in cells) for i in (0, 1)])
        at = [statistics.median(r["compiled at"][i] for r in runs) for i in (0, 1)] if "compiled at" in runs[0] \
            else None
        line = " ".join(f"{w:6.1f}/{c:<6.1f}" for w, c in cells)
        line += f" {at[0]:6.1f}/{at[1]:<6.1f}" if at else f" {'-':>13s}"
        decode = statistics.median(r["decode ms/token"] for r in runs)
        print(f"{key:16s} {line} {decode:13.1f}  {runs[0]['status']['state']}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
