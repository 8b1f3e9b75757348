"""Cluster start-up on Ray: time from `pdcluster up` to the first served token, and the memory
(RSS) of every process it runs.

    python benchmarks/startup.py [--workers 1] [--runs 1] [--no-baseline] [--skip-no-dashboard] [--out FILE]

Each run: `pdcluster up --detach` on a fresh local Ray head (its own namespace and state folder),
then one streamed greedy request through the router; the time to its first token counts from
the moment `up` was launched. RSS is read from /proc for every process below the Ray head,
grouped: Ray's own processes, the worker actors, the router actor, the serve-worker children.
Then `pdcluster down`. One more run uses --no-dashboard (Ray's dashboard is most of Ray's own
memory). The baseline is the same measure for `pdcluster serve` (no Ray): what Ray
adds. The demo model (tiny, random weights, CPU) keeps the engine's share small, so the figures
are the cluster machinery's. Writes JSON to --out (default benchmarks/results/startup.json).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from pdcluster.client import Client
from pdcluster.cluster.ray_head import descendants, stop_local_head
from pdcluster.sampling_params import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLI = (sys.executable, "-m", "pdcluster.cluster.cli")


def rss_mib(pid: int) -> float:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def first_token_s(grpc_address: str, t0: float) -> float:
    with Client(grpc_address, timeout=120) as client:
        for _ in client.generate_stream("Start-up is measured to", SamplingParams(max_tokens=4, temperature=0.0)):
            return time.monotonic() - t0
    raise RuntimeError("the stream ended without a token")


def memory_by_group(head_pid: int, ep: dict[str, Any]) -> dict[str, Any]:
    actors = {w["actor_pid"] for w in ep["instances"].values()}
    children = {w["child_pid"] for w in ep["instances"].values()}
    groups: dict[str, dict[str, Any]] = {}
    for pid in [head_pid, *descendants(head_pid)]:
        if pid in children:
            group = "serve-worker (engine) processes"
        elif pid in actors:
            group = "worker actors (supervisors)"
        elif pid == ep["actor_pid"]:
            group = "router actor"
        else:
            group = "ray (head, gcs, raylet, dashboard, idle workers)"
        g = groups.setdefault(group, {"count": 0, "rss_mib": 0.0, "processes": []})
        rss = rss_mib(pid)
        g["count"] += 1
        g["rss_mib"] = round(g["rss_mib"] + rss, 1)
        g["processes"].append({"pid": pid, "rss_mib": round(rss, 1), "cmd": cmdline(pid)[:100]})
    return groups


def run_up(workers: int, index: int, dashboard: bool = True) -> dict[str, Any]:
    ns = f"startup{os.getpid()}x{index}"
    env = {**os.environ, "PDCLUSTER_STATE_DIR": tempfile.mkdtemp(prefix="pdcluster-startup-")}
    env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    up = subprocess.run([*CLI, "up", "--detach", "--workers", str(workers), "--grpc-port", "0", "--http-port", "0",
                         "--namespace", ns, *([] if dashboard else ["--no-dashboard"])],
                        env=env, capture_output=True, text=True, timeout=600)
    ready_s = time.monotonic() - t0
    state_path = pathlib.Path(env["PDCLUSTER_STATE_DIR"]) / f"{ns}.json"
    try:
        if up.returncode != 0:
            raise RuntimeError(f"pdcluster up failed:\n{up.stderr[-3000:]}")
        line = next(x for x in up.stdout.splitlines() if x.startswith("PDCLUSTER_READY "))
        ep = json.loads(line.split(" ", 1)[1])
        ttft = first_token_s(ep["grpc"], t0)
        head_pid = json.loads(state_path.read_text())["head_pid"]
        memory = memory_by_group(head_pid, ep)
    finally:
        t1 = time.monotonic()
        down = subprocess.run([*CLI, "down", "--namespace", ns], env=env, capture_output=True, text=True, timeout=300)
        down_s = time.monotonic() - t1
        if state_path.exists():  # down failed: stop the head by its pid so nothing is left
            stop_local_head(json.loads(state_path.read_text())["head_pid"])
    return {"ready_s": round(ready_s, 2), "first_token_s": round(ttft, 2), "down_s": round(down_s, 2),
            "down_ok": down.returncode == 0, "steps_s": ep.get("startup_s"), "memory": memory}


def run_serve(workers: int) -> dict[str, Any]:
    """`pdcluster serve` (workers are plain subprocesses, the router in-process): the no-Ray baseline."""
    t0 = time.monotonic()
    proc = subprocess.Popen([*CLI, "serve", "--workers", str(workers), "--grpc-port", "0", "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("PDCLUSTER_READY "):
                ep = json.loads(line.split(" ", 1)[1])
                break
        else:
            raise RuntimeError("pdcluster serve exited before it was ready")
        ready_s = time.monotonic() - t0
        ttft = first_token_s(ep["grpc"], t0)
        rss = {"router (serve process)": round(rss_mib(proc.pid), 1),
               "serve-worker processes": round(sum(rss_mib(p) for p in ep.get("worker_pids", [])), 1)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return {"ready_s": round(ready_s, 2), "first_token_s": round(ttft, 2), "rss_mib": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--no-baseline", action="store_true", help="skip the `pdcluster serve` baseline")
    ap.add_argument("--skip-no-dashboard", action="store_true", help="skip the extra run with --no-dashboard")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "startup.json"))
    args = ap.parse_args()
    runs = [run_up(args.workers, i) for i in range(args.runs)]
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "workers": args.workers, "runs": runs,
        "up_to_ready_s_median": statistics.median(r["ready_s"] for r in runs),
        "up_to_first_token_s_median": statistics.median(r["first_token_s"] for r in runs),
        "rss_mib_total": round(sum(g["rss_mib"] for g in runs[-1]["memory"].values()), 1),
    }
    if not args.skip_no_dashboard:
        result["no_dashboard"] = run_up(args.workers, args.runs, dashboard=False)
    if not args.no_baseline:
        result["baseline_serve"] = run_serve(args.workers)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"pdcluster up -> ready {result['up_to_ready_s_median']:.1f}s, first token "
          f"{result['up_to_first_token_s_median']:.1f}s ({args.workers} worker(s), {args.runs} run(s))")
    print(f"  steps (s): {runs[-1]['steps_s']}; down {runs[-1]['down_s']:.1f}s")
    for name, g in runs[-1]["memory"].items():
        print(f"  {name:<52} {g['count']:>3} process(es) {g['rss_mib']:>8.1f} MiB RSS")
    print(f"  {'total':<52} {'':>16}{result['rss_mib_total']:>8.1f} MiB RSS")
    if "no_dashboard" in result:
        nd = result["no_dashboard"]
        total = sum(g["rss_mib"] for g in nd["memory"].values())
        ray_own = nd["memory"].get("ray (head, gcs, raylet, dashboard, idle workers)", {}).get("rss_mib", 0.0)
        print(f"with --no-dashboard: ready {nd['ready_s']:.1f}s, first token {nd['first_token_s']:.1f}s, "
              f"Ray's own processes {ray_own:.1f} MiB, total {total:.1f} MiB RSS")
    if "baseline_serve" in result:
        b = result["baseline_serve"]
        print(f"baseline `pdcluster serve`: ready {b['ready_s']:.1f}s, first token {b['first_token_s']:.1f}s, "
              f"RSS {b['rss_mib']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
