"""Engine start-up: model load plus torch.compile, cold (empty inductor cache) and warm, eager and
compiled. (benchmarks/startup.py measures the cluster's start-up on Ray; this is one engine's.)

    python benchmarks/engine_startup.py [--model demo|bench|PATH] [--runs 1] [--out FILE]

Each measurement is a fresh Python process: import pdcluster, build `LLM(model)` (weights loaded,
KV cache allocated, and with compile on the layers compiled at start-up by a warm-up step), then
one greedy token. Reported per phase: wall seconds and CPU seconds of the process and its children
(inductor runs gcc in children), so a loaded machine's figures can still be compared. "cold" runs
with an empty TORCHINDUCTOR_CACHE_DIR, "warm" with the cache the cold run filled. Compiled runs
set PDCLUSTER_COMPILE=1 (the demo model is below the auto threshold); eager ones --enforce-eager.
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
compiled = type(llm.engine.core.runner.forward_fn).__name__ == "CompiledForward"
print(json.dumps({"compiled": compiled, **{name: [round(t - pt, 2), round(c - pc, 2)]
                  for (name, t, c), (_, pt, pc) in zip(marks[1:], marks)}}))
"""


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
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PDCLUSTER_COMPILE": "1" if mode == "compiled" else "0"}
    out = subprocess.run([sys.executable, "-c", CHILD, model, mode], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="demo, bench (125M Llama) or a checkpoint path")
    ap.add_argument("--runs", type=int, default=1, help="cold+warm pairs per mode (medians printed)")
    ap.add_argument("--out", default=None, help="write the runs as JSON here")
    args = ap.parse_args()
    model = resolve_model(args.model)
    rows: dict[str, list[dict]] = {}
    for _ in range(args.runs):
        for mode in ("eager", "compiled"):
            with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
                for state in ("cold", "warm"):
                    rows.setdefault(f"{mode} {state}", []).append(run_once(model, mode, cache))
    print(f"model {args.model} ({model}); wall s / CPU s (process + children), median of {args.runs}")
    print(f"{'':14s} {'import':>13s} {'load+compile':>13s} {'first token':>13s} {'total':>13s}  compiled")
    for key, runs in rows.items():
        cells = []
        for phase in ("import", "load+compile", "first token"):
            cells.append([statistics.median(r[phase][i] for r in runs) for i in (0, 1)])
        total = [sum(c[i] for c in cells) for i in (0, 1)]
        print(f"{key:14s} " + " ".join(f"{w:6.1f}/{c:<6.1f}" for w, c in [*cells, total])
              + f"  {runs[0]['compiled']}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
