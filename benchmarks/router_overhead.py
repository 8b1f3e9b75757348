"""What the router adds in front of a real worker: latency per request and per streamed token,
and its CPU cost per request.

    python benchmarks/router_overhead.py [--pairs 300] [--tokens 8] [--seconds 5] [--rounds 3] [--skip-throughput]

One `pdcluster serve-worker` (the built-in demo model: tiny, random weights; CPU unless
PDCLUSTER_DEVICE says otherwise) and two `pdcluster router`s in front of it: "router" as deployed
(one multiplexed Worker.GenerateStream to the worker) and "router_call" (--worker-channel call: a
Worker.Generate call per request), so both channels are measured side by side in one run.

1. Latency: the same greedy request (8 prompt tokens, --tokens streamed tokens) sent straight to
   the worker and then through each router to that same worker, one at a time, --pairs rounds.
   The model's cost is in both, so the difference is the router's: added latency per request =
   router minus direct, as the p50 and p99 of the paired differences (and the difference of the
   two distributions' p50 and p99); per streamed token = the same for the mean gap between
   streamed tokens. The client runs on the routers' core, not the worker's (see run()).
2. Throughput: the routers pinned to one core, the worker and this load generator on the
   other(s), --concurrency streams for --seconds, at 1 and --long-tokens tokens per request. The
   worker (the model) limits the achieved rate here; what is the router's is its CPU time (from
   /proc) per request: 1 / cpu_seconds_per_request is its ceiling on one core, and the
   difference between the two lengths gives its CPU per streamed token.
3. Floor: the same throughput run against a bare grpc.aio proxy (Generate -> Worker.Generate, no
   validation, routing, metrics or retries): what a naive Python gRPC proxy costs on this
   machine. Windows of the routers and the proxy rotate, --rounds times each, so that other jobs
   on a shared machine weigh on all alike; the figures are the medians of the windows, and
   cpu_ratio_to_bare_proxy the median of the per-round ratios.

Targets (issue #4): <= 1 ms p50 added per request, <= 50 us per streamed token, >= 1,000 req/s.
Writes JSON to --out (default benchmarks/results/router_overhead.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import grpc

from pdcluster._proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

PY = sys.executable
# The router as deployed (one multiplexed stream per worker) and with a gRPC call per request.
ROUTERS = {"router": "stream", "router_call": "call"}
PROMPT = list(range(10, 18))


def spawn(argv: list[str], procs: list[subprocess.Popen], env: dict | None = None,
          cpus: set[int] | None = None) -> dict:
    """Start a process (added to procs, which the caller stops) and wait for its ready line."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    procs.append(proc)
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    for line in proc.stdout:
        if line.startswith("PDCLUSTER_READY "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"{argv[:6]} exited with {proc.wait()} before ready")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- latency ------------------------------------------------------------------------------------
def timed_stream(call) -> tuple[float, float]:
    """(e2e seconds, mean gap between streamed tokens)."""
    t0 = time.perf_counter()
    arrivals = [time.perf_counter() for r in call if r.token_ids]
    e2e = time.perf_counter() - t0
    gap = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else 0.0
    return e2e, gap


def latency(worker_addr: str, routers: dict[str, str], pairs: int, tokens: int) -> dict:
    """Each round sends the request straight to the worker, then through each router, one at a time."""
    sp = common_pb2.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    wreq = worker_pb2.WorkerGenerateRequest(prompt_token_ids=PROMPT, sampling_params=sp, stream=True)
    rreq = router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=PROMPT), sampling_params=sp,
                                      stream=True)
    channels = {name: grpc.insecure_channel(addr) for name, addr in routers.items()}
    try:
        with grpc.insecure_channel(worker_addr) as wch:
            w = worker_pb2_grpc.WorkerStub(wch)
            stubs = {name: router_pb2_grpc.RouterStub(ch) for name, ch in channels.items()}
            direct: list = []
            routed: dict[str, list] = {name: [] for name in routers}
            for i in range(pairs + 20):  # the first 20 warm up every path
                wreq.request_id = f"d{i}"
                d = timed_stream(w.Generate(wreq, timeout=60))
                rs = {name: timed_stream(stub.Generate(rreq, timeout=60)) for name, stub in stubs.items()}
                if i >= 20:
                    direct.append(d)
                    for name, r in rs.items():
                        routed[name].append(r)
    finally:
        for ch in channels.values():
            ch.close()
    out: dict = {}
    for router_name, rows in routed.items():
        out[router_name] = {}
        for name, k in (("request", 0), ("token", 1)):
            ds, rs = [x[k] for x in direct], [x[k] for x in rows]
            out[router_name][name] = {
                "direct_p50_us": pct(ds, 0.5) * 1e6, "router_p50_us": pct(rs, 0.5) * 1e6,
                "added_p50_us": (pct(rs, 0.5) - pct(ds, 0.5)) * 1e6,
                "added_p99_us": (pct(rs, 0.99) - pct(ds, 0.99)) * 1e6,
                "paired_diff_p50_us": statistics.median(b - a for a, b in zip(ds, rs)) * 1e6,
                "paired_diff_p99_us": pct([b - a for a, b in zip(ds, rs)], 0.99) * 1e6,
            }
    return out


# -- throughput ---------------------------------------------------------------------------------
async def load(router_addr: str, concurrency: int, seconds: float, tokens: int) -> int:
    sp = common_pb2.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    req = router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=PROMPT), sampling_params=sp,
                                     stream=True)
    done = 0
    end = time.perf_counter() + seconds
    async with grpc.aio.insecure_channel(router_addr) as ch:
        stub = router_pb2_grpc.RouterStub(ch)

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < end:
                async for _ in stub.Generate(req, timeout=30):
                    pass
                done += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return done


def throughput(router: subprocess.Popen, router_addr: str, concurrency: int, seconds: float, tokens: int) -> dict:
    asyncio.run(load(router_addr, concurrency, 1.0, tokens))  # warm up
    cpu0, t0 = cpu_seconds(router.pid), time.perf_counter()
    n = asyncio.run(load(router_addr, concurrency, seconds, tokens))
    cpu, wall = cpu_seconds(router.pid) - cpu0, time.perf_counter() - t0
    return {"tokens_per_request": tokens, "requests": n, "achieved_req_per_s": n / wall,
            "router_cpu_us_per_request": cpu / n * 1e6, "router_cpu_utilisation": cpu / wall,
            "one_core_ceiling_req_per_s": n / cpu if cpu else float("inf")}


def _median_window(ws: list[dict]) -> dict:
    """The median of each figure over a server's windows, and the windows themselves."""
    out = {k: statistics.median(w[k] for w in ws) for k in ws[0] if k != "tokens_per_request"}
    out["one_core_ceiling_req_per_s"] = 1e6 / out["router_cpu_us_per_request"]
    return {"tokens_per_request": ws[0]["tokens_per_request"], **out, "windows": ws}


# -- the bare-proxy floor -----------------------------------------------------------------------
class _BareProxy(router_pb2_grpc.RouterServicer):
    def __init__(self, worker_addr: str) -> None:
        self.stub = worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(worker_addr))
        self.n = 0

    async def Generate(self, request, context):  # noqa: N802
        self.n += 1
        call = self.stub.Generate(worker_pb2.WorkerGenerateRequest(
            request_id=str(self.n), prompt_token_ids=request.prompt_token_ids.ids,
            sampling_params=request.sampling_params, stream=request.stream))
        while (r := await call.read()) is not grpc.aio.EOF:
            yield router_pb2.GenerateResponse(token_ids=r.token_ids, text=r.text, finished=r.finished)


async def _serve_bare_proxy(worker_addr: str) -> None:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(_BareProxy(worker_addr), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print("PDCLUSTER_READY " + json.dumps({"grpc": f"127.0.0.1:{port}"}), flush=True)
    await server.wait_for_termination()


def run(args: argparse.Namespace) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    router_cpu, rest = {cpus[0]}, set(cpus[1:]) or {cpus[0]}
    procs: list[subprocess.Popen] = []
    try:
        worker_argv = [PY, "-m", "pdcluster.cluster.cli", "serve-worker", "--role", "both", "--model", args.model,
                       "--max-model-len", "256", "--num-kv-blocks", str(args.num_kv_blocks), "--log-level", "WARNING"]
        wready = spawn(worker_argv, procs, {"PDCLUSTER_DEVICE": os.environ.get("PDCLUSTER_DEVICE", "cpu")}, rest)
        servers: dict[str, tuple[subprocess.Popen, str]] = {}
        for name, channel in ROUTERS.items():
            ready = spawn([PY, "-m", "pdcluster.cluster.cli", "router", "--workers", wready["address"], "--model",
                           args.model, "--grpc-port", "0", "--http-port", "-1", "--policy", "round_robin",
                           "--worker-channel", channel, "--log-level", "WARNING"], procs, cpus=router_cpu)
            servers[name] = (procs[-1], ready["grpc"])
        # The load generator shares the routers' core, not the worker's: on the worker's core it
        # would slow the model whenever a token reaches it while the next step runs, and the
        # routers (which deliver later than the worker does) would be charged for that. Here the
        # routers compete with the client instead, which can only count against them.
        os.sched_setaffinity(0, router_cpu)
        time.sleep(1.0)  # first health check admitted the worker
        result = {"worker": "serve-worker, demo model, " + os.environ.get("PDCLUSTER_DEVICE", "cpu"),
                  "prompt_tokens": len(PROMPT), "tokens": args.tokens, "pairs": args.pairs,
                  "latency": latency(wready["address"], {n: a for n, (_, a) in servers.items()}, args.pairs,
                                     args.tokens)}
        if not args.skip_throughput:
            os.sched_setaffinity(0, rest)  # here the router's core is the one being measured
            fready = spawn([PY, __file__, "--bare-proxy", wready["address"]], procs, cpus=router_cpu)
            servers["bare"] = (procs[-1], fready["grpc"])
            lengths = (1, args.long_tokens)
            windows: dict[tuple[str, int], list[dict]] = {}
            for _ in range(args.rounds):
                for t in lengths:
                    for name, (proc, address) in servers.items():
                        windows.setdefault((name, t), []).append(
                            throughput(proc, address, args.concurrency, args.seconds, t))
            result["throughput"] = {name: [_median_window(windows[name, t]) for t in lengths] for name in servers}
            result["router_cpu_us_per_streamed_token"] = {}
            result["cpu_ratio_to_bare_proxy"] = {}
            for name in ROUTERS:
                one, many = result["throughput"][name]
                result["router_cpu_us_per_streamed_token"][name] = (
                    many["router_cpu_us_per_request"] - one["router_cpu_us_per_request"]) / (lengths[1] - lengths[0])
                result["cpu_ratio_to_bare_proxy"][name] = {
                    str(t): statistics.median(r["router_cpu_us_per_request"] / b["router_cpu_us_per_request"]
                                              for r, b in zip(windows[name, t], windows["bare", t]))
                    for t in lengths}
        return result
    finally:
        os.sched_setaffinity(0, set(cpus))
        for p in procs:  # each by its own pid
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir (the worker's checkpoint, the router's tokenizer); "
                   "default: the built-in demo model")
    p.add_argument("--pairs", type=int, default=300)
    p.add_argument("--tokens", type=int, default=8, help="streamed tokens per request in the latency phase")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=5.0, help="length of one throughput window")
    p.add_argument("--rounds", type=int, default=3, help="router/bare-proxy window pairs per request length")
    p.add_argument("--long-tokens", type=int, default=17, help="tokens per request of the second throughput run")
    p.add_argument("--num-kv-blocks", type=int, default=256, help="the worker's KV cache (blocks of 16 tokens)")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "router_overhead.json"))
    p.add_argument("--bare-proxy", default=None, metavar="WORKER", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bare_proxy:
        asyncio.run(_serve_bare_proxy(args.bare_proxy))
        return 0
    if args.model is None:
        from pdcluster.models.demo import ensure_demo_model

        args.model = ensure_demo_model()
    load_before = os.getloadavg()
    result = run(args)
    result["load_average_before_after"] = [load_before[0], os.getloadavg()[0]]
    out = {"note": f"one run on a {len(os.sched_getaffinity(0))}-core machine, load average "
                   f"{load_before[0]:.1f} before the run (other jobs move these numbers); re-run: "
                   "python benchmarks/router_overhead.py",
           "runs": [result]}
    print(json.dumps(out, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
