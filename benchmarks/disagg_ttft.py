"""Where the KV hand-off sits in a disaggregated request's timeline, for 1k- and 4k-token prompts.

    python benchmarks/disagg_ttft.py [--transport tcp|shm] [--repeats 5]

Starts `pdcluster serve --prefill 1 --decode 1` and `pdcluster serve --workers 1` (aggregated) on a
random-weight Llama-shaped model (bench-llama-125m geometry, 8k positions) and measures, per prompt
length, median over --repeats requests:
  ttft          client-observed time to the first token (disaggregated: the prefill leg's token,
                streamed before the KV moves)
  first_gap     time from the first to the second token: prefill-leg finish -> KV transfer ->
                decode-leg step; the hand-off cost shows up here, not in TTFT
  itl           median gap between later tokens
  handoff       first_gap - itl: the time the hand-off adds to the request
and reports handoff / ttft, the share the transfer would add if it sat on the TTFT path.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_model import ensure_bench_model  # noqa: E402


def start(model: str, disagg: bool, transport: str, max_len: int) -> tuple[subprocess.Popen, dict]:
    worker_args = f"--max-model-len {max_len} --max-num-batched-tokens 8192"
    if disagg:
        pools = ["--prefill", "1", "--decode", "1"]
        worker_args += f" --kv-connector-options '{json.dumps({'transport': transport})}'"
    else:
        pools = ["--workers", "1"]
    cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--model", model, *pools, "--grpc-port", "0",
           "--http-port", "-1", "--policy", "round_robin", "--worker-args", worker_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("PDCLUSTER_READY "):
            return proc, json.loads(line.split(" ", 1)[1])
    raise RuntimeError("cluster did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def measure(address: str, prompt_len: int, repeats: int, seed: int) -> dict[str, float]:
    from pdcluster.client import Client
    from pdcluster.sampling_params import SamplingParams

    rng = random.Random(seed)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ttft, gap, itl = [], [], []
    with Client(address, timeout=600) as c:
        for _ in range(repeats):
            prompt = [rng.randrange(3, 32000) for _ in range(prompt_len)]  # fresh: no prefix hits
            t0 = time.perf_counter()
            times = []
            for d in c.generate_stream(prompt, sp):
                times += [time.perf_counter()] * len(d.token_ids)
            ttft.append(times[0] - t0)
            gap.append(times[1] - times[0])
            itl.append(statistics.median(b - a for a, b in zip(times[1:], times[2:])))
    return {"ttft_s": statistics.median(ttft), "first_gap_s": statistics.median(gap), "itl_s": statistics.median(itl)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/pdcluster/bench-llama-125m-8k"))
    ap.add_argument("--transport", choices=["tcp", "shm"], default="tcp")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = ensure_bench_model(args.model_dir, max_position_embeddings=8192)
    max_len = max(args.lengths) + 64
    rows = {}
    for mode in ("aggregated", "disaggregated"):
        proc, ready = start(model, mode == "disaggregated", args.transport, max_len)
        try:
            measure(ready["grpc"], 32, 1, seed=99)  # warm-up
            rows[mode] = {n: measure(ready["grpc"], n, args.repeats, seed=n) for n in args.lengths}
        finally:
            stop(proc)
    print(f"transport={args.transport} repeats={args.repeats} (medians)")
    print(f"{'prompt':>7} {'mode':<14}{'ttft ms':>9}{'1st gap ms':>12}{'itl ms':>8}{'handoff ms':>12}{'handoff/ttft':>14}")
    for n in args.lengths:
        for mode in ("aggregated", "disaggregated"):
            r = rows[mode][n]
            handoff = r["first_gap_s"] - r["itl_s"]
            r["handoff_s"] = handoff
            r["handoff_share_of_ttft"] = handoff / r["ttft_s"]
            print(f"{n:>7} {mode:<14}{r['ttft_s'] * 1e3:>9.0f}{r['first_gap_s'] * 1e3:>12.1f}{r['itl_s'] * 1e3:>8.1f}"
                  f"{handoff * 1e3:>12.1f}{r['handoff_share_of_ttft']:>14.1%}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
