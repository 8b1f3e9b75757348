"""What the router adds: latency per request and per streamed token, and its CPU cost per request.

    python benchmarks/router_overhead.py                 # fake worker (no model: pure overhead)
    python benchmarks/router_overhead.py --real-worker   # also a real serve-worker, demo model, CPU

1. Latency: the same request (8 prompt tokens, --tokens streamed tokens) sent alternately straight
   to the worker and through the router, one at a time, --pairs times. Added latency per request =
   router minus direct, at p50 and p99 (percentiles of each distribution, and the median of the
   paired differences); per streamed token = the same for the mean gap between streamed tokens.
2. Throughput: the router process pinned to one core, the worker and this load generator on the
   other(s), --concurrency streams for --seconds. The router's CPU time (from /proc) per request
   gives its ceiling on one core: 1 / cpu_seconds_per_request, whatever limits the achieved rate.

3. Floor: the same throughput run against a bare grpc.aio proxy (Generate -> Worker.Generate, no
   validation, routing, metrics or retries): what any Python gRPC proxy costs on this machine, so
   the router's own share is the difference.

Targets (issue #4): <= 1 ms p50 added per request, <= 50 us per streamed token, >= 1,000 req/s.
Writes JSON to --out when given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import grpc

from pdcluster._proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

PY = sys.executable
PROMPT = list(range(10, 18))


def spawn(argv: list[str], env: dict | None = None, cpus: set[int] | None = None) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, **(env or {})})
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    for line in proc.stdout:
        if line.startswith("PDCLUSTER_READY "):
            return proc, json.loads(line.split(" ", 1)[1])
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


def latency(worker_addr: str, router_addr: str, pairs: int, tokens: int) -> dict:
    sp = common_pb2.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    wreq = worker_pb2.WorkerGenerateRequest(prompt_token_ids=PROMPT, sampling_params=sp, stream=True)
    rreq = router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=PROMPT), sampling_params=sp,
                                      stream=True)
    with grpc.insecure_channel(worker_addr) as wch, grpc.insecure_channel(router_addr) as rch:
        w, r = worker_pb2_grpc.WorkerStub(wch), router_pb2_grpc.RouterStub(rch)
        direct, routed = [], []
        for i in range(pairs + 20):  # the first 20 warm up both paths
            wreq.request_id = f"d{i}"
            d = timed_stream(w.Generate(wreq, timeout=60))
            rr = timed_stream(r.Generate(rreq, timeout=60))
            if i >= 20:
                direct.append(d)
                routed.append(rr)
    out = {}
    for name, k in (("request", 0), ("token", 1)):
        ds, rs = [x[k] for x in direct], [x[k] for x in routed]
        out[name] = {
            "direct_p50_us": pct(ds, 0.5) * 1e6, "router_p50_us": pct(rs, 0.5) * 1e6,
            "added_p50_us": (pct(rs, 0.5) - pct(ds, 0.5)) * 1e6, "added_p99_us": (pct(rs, 0.99) - pct(ds, 0.99)) * 1e6,
            "paired_diff_p50_us": statistics.median(b - a for a, b in zip(ds, rs)) * 1e6,
        }
    return out


# -- throughput ---------------------------------------------------------------------------------
async def load(router_addr: str, concurrency: int, seconds: float, tokens: int) -> int:
    sp = common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True)
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


def run(worker_argv: list[str], worker_env: dict, args: argparse.Namespace, label: str) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    router_cpu, rest = {cpus[0]}, set(cpus[1:]) or {cpus[0]}
    procs = []
    try:
        worker, wready = spawn(worker_argv, worker_env, rest)
        procs.append(worker)
        router, rready = spawn([PY, "-m", "pdcluster.cluster.cli", "router", "--workers", wready["address"],
                                "--model", args.model, "--grpc-port", "0", "--http-port", "-1", "--policy",
                                "round_robin", "--log-level", "WARNING"], cpus=router_cpu)
        procs.append(router)
        os.sched_setaffinity(0, rest)
        time.sleep(1.0)  # first health check admitted the worker
        result = {"worker": label, "latency": latency(wready["address"], rready["grpc"], args.pairs, args.tokens)}
        if not args.skip_throughput:
            result["throughput"] = [throughput(router, rready["grpc"], args.concurrency, args.seconds, t)
                                    for t in (1, 33)]
            one, many = result["throughput"]
            result["router_cpu_us_per_streamed_token"] = (
                many["router_cpu_us_per_request"] - one["router_cpu_us_per_request"]) / 32
            floor, fready = spawn([PY, __file__, "--bare-proxy", wready["address"]], cpus=router_cpu)
            procs.append(floor)
            result["bare_proxy_floor"] = [throughput(floor, fready["grpc"], args.concurrency, args.seconds, t)
                                          for t in (1, 33)]
        return result
    finally:
        os.sched_setaffinity(0, set(cpus))
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir (tokenizer; the real worker's model); default: demo")
    p.add_argument("--pairs", type=int, default=300)
    p.add_argument("--tokens", type=int, default=8, help="streamed tokens per request in the latency phase")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--real-worker", action="store_true", help="also measure against serve-worker (demo model)")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--bare-proxy", default=None, metavar="WORKER", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bare_proxy:
        asyncio.run(_serve_bare_proxy(args.bare_proxy))
        return 0
    if args.model is None:
        from pdcluster.models.demo import demo_model_dir

        subprocess.run([PY, "-m", "pdcluster.cluster.cli", "demo-model"], check=True, stdout=subprocess.DEVNULL)
        args.model = str(demo_model_dir())
    results = [run([PY, "-m", "pdcluster.router.testing", "--port", "0"], {}, args, "fake")]
    if args.real_worker:
        argv = [PY, "-m", "pdcluster.cluster.cli", "serve-worker", "--model", args.model, "--max-model-len", "512"]
        args.skip_throughput = True  # the model, not the router, would be measured
        results.append(run(argv, {"PDCLUSTER_DEVICE": "cpu"}, args, "real (demo model, CPU)"))
    print(json.dumps(results, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
