"""What the KV hand-off adds to a disaggregated request, and where that time goes.

    python benchmarks/disagg_ttft.py [--transport tcp|shm|auto] [--lengths 256 1024 2048] [--repeats 5]
                                     [--mode sequential|concurrent|both]

Starts `pdcluster serve --prefill 1 --decode 1` (P2P) and `pdcluster serve --workers 1` (aggregated)
side by side on a random-weight Llama-shaped model (bench-llama-125m geometry, 8k positions) and
sends one request to each in turn (aggregated first on even repeats, disaggregated first on odd
ones), so both see the same machine load. --mode picks the router's --disagg-mode; `both` starts
one 1P+1D cluster per mode beside the aggregated one and interleaves all three (order rotated per
repeat). Per prompt length, medians over --repeats:
  ttft          client-observed time to the first token (disaggregated: the prefill leg's token,
                streamed before the KV moves)
  first_gap     time from the first to the second token: prefill-leg finish -> KV transfer ->
                decode-leg step; the hand-off cost shows up here, not in TTFT
  itl           median gap between later tokens
  handoff       first_gap - itl: the time the hand-off adds to the request
  handoff / aggregated ttft: the target is <= 5%
and, for the disaggregated requests, the hand-off broken down by timestamps every process writes
(PDCLUSTER_HANDOFF_TRACE, pdcluster/handoff_trace.py; wall clock, one host):
  p_out      prefill: lease issued -> router has the final response (output path, gRPC)
  hop        router: prefill response -> decode leg sent (t0 streamed to the client in between);
             concurrent: prefill response -> ProvideKVParams sent (the leg was sent with the prefill)
  admit      decode leg sent -> decode scheduler sees it (gRPC, worker, engine queue); concurrent:
             ProvideKVParams sent -> decode scheduler sees it (the RPC, the engine queue)
  alloc      scheduler: matched -> blocks allocated (LoadSpec issued)
  submit     allocated -> load thread started (next step's connector metadata)
  handshake  producer handshake (cached after the first request)
  open       OPEN on the side channel (retried while the producer has not registered the lease)
  transfer   the bytes (TCP scatter READ or shm memcpy), MAC checked
  done       the done notice round trip ("released")
  notice     loader finished -> scheduler sees finished_recving
  rpc        concurrent only: ProvideKVParams sent -> the decode worker has the params (part of admit)
  step       request ready -> its first decode token reaches the router (t0's step, sampling, stream)
  path       p.finished -> d.ready: the hand-off proper (everything but the decode step, which an
             aggregated run pays too), and path / aggregated ttft: steadier than first_gap - itl
             on a busy machine, where one step's jitter is as large as the hand-off
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_model import ensure_bench_model  # noqa: E402

# (segment, from event, to event); events as written by pdcluster.handoff_trace.trace
SEGMENTS = [("p_out", "p.finished", "r.prefill_done"), ("hop", "r.prefill_done", "r.decode_sent"),
            ("admit", "r.decode_sent", "d.match"), ("alloc", "d.match", "d.alloc"),
            ("submit", "d.alloc", "d.load_start"), ("handshake", "d.load_start", "d.handshake"),
            ("open", "d.handshake", "d.open"), ("transfer", "d.open", "d.copied"),
            ("done", "d.copied", "d.done"), ("notice", "d.done", "d.ready"),
            ("step", "d.ready", "r.decode_token")]
# Concurrent mode (r.mode_concurrent in the trace): the decode leg left with the prefill leg; what
# is left on the path starts when the router hands the params over.
CONCURRENT = {"hop": ("r.prefill_done", "r.provide_sent"), "admit": ("r.provide_sent", "d.match")}


def start(model: str, disagg: bool, transport: str, max_len: int, extra: list[str],
          env: dict[str, str]) -> tuple[subprocess.Popen, dict]:
    worker_args = f"--max-model-len {max_len} --max-num-batched-tokens 8192"
    if disagg:
        pools = ["--prefill", "1", "--decode", "1", *extra]
        worker_args += f" --kv-connector-options '{json.dumps({'transport': transport})}'"
    else:
        pools = ["--workers", "1"]
    cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--model", model, *pools, "--grpc-port", "0",
           "--http-port", "-1", "--policy", "round_robin", "--worker-args", worker_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                            env=env)
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


def one(client, prompt: list[int], request_id: str) -> tuple[float, float, float]:
    from pdcluster.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    t0 = time.perf_counter()
    times: list[float] = []
    for d in client.generate_stream(prompt, sp, request_id=request_id):
        times += [time.perf_counter()] * len(d.token_ids)
    return times[0] - t0, times[1] - times[0], statistics.median(b - a for a, b in zip(times[1:], times[2:]))


def breakdown(trace_path: pathlib.Path, request_id: str) -> dict[str, float]:
    events: dict[str, float] = {}
    for line in trace_path.read_text().splitlines():
        ts, event, rid = line.split(" ", 2)
        if rid == request_id:
            events.setdefault(event, float(ts))  # the first of each (r.decode_token: first decode token)
    segments = [(name, *CONCURRENT.get(name, (a, b))) if "r.mode_concurrent" in events else (name, a, b)
                for name, a, b in SEGMENTS]
    out = {name: events[b] - events[a] for name, a, b in segments if a in events and b in events}
    if "r.provide_sent" in events and "d.provided" in events:  # concurrent: the RPC's share of admit
        out["rpc"] = events["d.provided"] - events["r.provide_sent"]
    if "p.finished" in events and "d.ready" in events:
        out["path"] = events["d.ready"] - events["p.finished"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/pdcluster/bench-llama-125m-8k"))
    ap.add_argument("--transport", choices=["tcp", "shm", "auto"], default="tcp")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mode", choices=["sequential", "concurrent", "both"], default="sequential",
                    help="the disaggregated cluster's router --disagg-mode (both: one cluster each)")
    ap.add_argument("--serve-args", default="", help="extra `pdcluster serve` flags for the disaggregated cluster")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from pdcluster.client import Client

    model = ensure_bench_model(args.model_dir, max_position_embeddings=8192)
    max_len = max(args.lengths) + 64
    trace_path = pathlib.Path(tempfile.mkdtemp(prefix="pdc-handoff-")) / "trace.txt"
    # Compiled before serving: under the default (background) every engine compiles on one of the
    # cores while the first requests run, which doubled aggregated TTFT at 256 tokens (the share's
    # denominator) for the first ~30 s.
    env = dict(os.environ, PDCLUSTER_HANDOFF_TRACE=str(trace_path))
    env.setdefault("PDCLUSTER_COMPILE_START", "wait")
    procs = {}
    disagg = ["sequential", "concurrent"] if args.mode == "both" else [args.mode]
    modes = ["aggregated"] + [f"disagg-{m}" for m in disagg]
    try:
        for mode in modes:
            extra = args.serve_args.split() + (["--disagg-mode", mode.split("-", 1)[1]] if mode != "aggregated" else [])
            procs[mode] = start(model, mode != "aggregated", args.transport, max_len, extra, env)
        clients = {mode: Client(ready["grpc"], timeout=600) for mode, (_, ready) in procs.items()}
        rng = random.Random(0)
        for mode, c in clients.items():  # warm-up: first handshake, compile, allocator
            for n in (32, min(args.lengths)):
                one(c, [rng.randrange(3, 32000) for _ in range(n)], f"warm-{mode}-{n}")
        raw: dict[str, dict[int, list]] = {m: {n: [] for n in args.lengths} for m in clients}
        parts: dict[str, dict[int, list[dict[str, float]]]] = {m: {n: [] for n in args.lengths} for m in modes[1:]}
        for i in range(args.repeats):
            for n in args.lengths:
                order = list(clients)[i % len(clients):] + list(clients)[:i % len(clients)]
                if i % 2:
                    order.reverse()
                for mode in order:
                    prompt = [rng.randrange(3, 32000) for _ in range(n)]  # fresh: no prefix hits
                    rid = f"bench-{uuid.uuid4().hex[:12]}"
                    raw[mode][n].append(one(clients[mode], prompt, rid))
                    if mode != "aggregated":
                        parts[mode][n].append(breakdown(trace_path, rid))
        for c in clients.values():
            c.close()
    finally:
        for proc, _ in procs.values():
            stop(proc)
        shutil.rmtree(trace_path.parent, ignore_errors=True)  # read per request above; nothing left in /tmp
    rows: dict[str, dict] = {}
    print(f"transport={args.transport} repeats={args.repeats} mode={args.mode} serve_args={args.serve_args!r} "
          f"load average {os.getloadavg()[0]:.1f} (medians; aggregated and disaggregated requests interleaved)")
    print(f"{'prompt':>7} {'mode':<18}{'ttft ms':>9}{'1st gap ms':>12}{'itl ms':>8}{'handoff ms':>12}"
          f"{'handoff/agg ttft':>18}")
    for n in args.lengths:
        agg_ttft = statistics.median(r[0] for r in raw["aggregated"][n])
        for mode in clients:
            ttft, gap, itl = (statistics.median(r[k] for r in raw[mode][n]) for k in range(3))
            handoff = statistics.median(r[1] - r[2] for r in raw[mode][n])
            rows.setdefault(mode, {})[n] = {"ttft_s": ttft, "first_gap_s": gap, "itl_s": itl, "handoff_s": handoff,
                                            "handoff_share_of_agg_ttft": handoff / agg_ttft}
            print(f"{n:>7} {mode:<18}{ttft * 1e3:>9.0f}{gap * 1e3:>12.1f}{itl * 1e3:>8.1f}{handoff * 1e3:>12.1f}"
                  f"{handoff / agg_ttft:>18.1%}")
    print("\ndisaggregated hand-off breakdown, ms (medians)")
    names = [name for name, _, _ in SEGMENTS] + ["rpc", "path"]
    print(f"{'prompt':>7} {'mode':<18}" + "".join(f"{name:>10}" for name in names) + f"{'path/agg ttft':>15}")
    for n in args.lengths:
        for mode in modes[1:]:
            med = {name: statistics.median(p[name] for p in parts[mode][n] if name in p)
                   for name in names if any(name in p for p in parts[mode][n])}
            rows[mode][n]["breakdown_s"] = med
            share = med["path"] / rows["aggregated"][n]["ttft_s"] if "path" in med else float("nan")
            rows[mode][n]["path_share_of_agg_ttft"] = share
            print(f"{n:>7} {mode:<18}" + "".join(f"{med[name] * 1e3:>10.1f}" if name in med else f"{'-':>10}"
                                                 for name in names) + f"{share:>15.1%}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
