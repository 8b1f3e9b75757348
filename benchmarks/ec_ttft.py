"""TTFT through `pdcluster serve` of a multimodal request whose encoding is computed locally vs
fetched over the p2p_ec connector (shared memory, TCP), 1 and 4 images; bytes moved vs tower time.

    .venv/bin/python benchmarks/ec_ttft.py [--images 1,4] [--repeats 5] [--json out.json]

Model: a random LLaVA made with transformers in a temp dir (benchmarks/ec_transfer.py's
make_checkpoint): a CLIP-B/16-sized tower (224 px, patch 16 -> 196 placeholders per image,
hidden 768, 12 layers, MLP 3072, vision_feature_layer -2) and a projector to a 2048-wide,
one-layer Llama decoder (vocab 384), float32. So the tower costs what a CLIP-B/16 costs, each
image's encoding is 196 x 2048 x 4 B = 1.6 MB, and the decoder's prefill is cheap: TTFT is
mostly preprocessing + tower (or fetch) + the hops.

Three clusters run side by side, all workers on loopback, eager (--enforce-eager):
  local    serve --prefill 1 --decode 1 --ec-connector none: the prefill worker encodes each
           image itself (first sight; every measured request has fresh images)
  ec_shm   serve --encode 1 --prefill 2 --decode 1 (p2p_ec, transport auto = shared memory here)
  ec_tcp   the same with --ec-connector-options '{"transport": "tcp"}' (TCP data plane, payload MAC)
In the EC clusters each measured request follows a warm-up request with the SAME images (other
text): the warm-up makes encode-0 compute and hold them (prefill-0 fetches them); the measured
request's Encode is an encoder-cache hit, and round_robin (one decode worker, so the policy is
consulted for prefill only) sends it to prefill-1, which has never seen the images and fetches
them. Each measured request is checked on the workers' /metrics: in the EC modes no image may
be computed and all must come over EC (pdcluster_mm_items_total{source="remote"}), in local all
are computed; a request that does not match is reported and left out of the medians.

Per round and image count the modes run one request each, in a rotating order (the box is
shared: interleaving spreads load swings over all modes), and the tower + projector alone is
timed in this process on fresh images (an encoder-only engine, no cache): the recomputation a
fetch replaces. Bytes are the deltas of pdcluster_ec_transfer_bytes_total summed over the
cluster's workers during the measured request. TTFT is measured as `pdcluster bench serve`
does (cluster/bench/openai_backend.py: send -> first chunk with text), streaming 4 tokens.
On a box with more runnable threads than cores, --threads 1 keeps torch's OpenMP team from
waiting on descheduled threads (2 threads on 2 loaded cores: ~3 s wall for one image's tower,
1 thread: ~0.5 s).
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
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from ec_serve import TEMPLATE, stop  # noqa: E402
from ec_transfer import make_checkpoint  # noqa: E402

MODES = ("local", "ec_shm", "ec_tcp")
LAYOUT = {"local": ["--prefill", "1", "--decode", "1", "--ec-connector", "none"],
          "ec_shm": ["--encode", "1", "--prefill", "2", "--decode", "1"],
          "ec_tcp": ["--encode", "1", "--prefill", "2", "--decode", "1"]}
WORKER_ARGS = f"--max-model-len 1024 --num-kv-blocks 256 --max-message-bytes {32 << 20} --enforce-eager"
METRICS = ("pdcluster_ec_transfer_bytes_total", "pdcluster_mm_items_total")


def start(model: str, mode: str) -> subprocess.Popen:
    worker_args = WORKER_ARGS + (" --ec-connector-options '{\"transport\": \"tcp\"}'" if mode == "ec_tcp" else "")
    cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--model", model, *LAYOUT[mode],
           "--grpc-port", "0", "--http-port", "0", "--policy", "round_robin", "--max-message-bytes", str(32 << 20),
           "--worker-args", worker_args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)


def wait_ready(proc: subprocess.Popen) -> dict:
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith("PDCLUSTER_READY "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"serve exited with {proc.wait()}")


def scrape(ready: dict) -> dict[str, dict[str, float]]:
    """Per instance: {metric{labels}: value} for the EC metrics."""
    out = {}
    for name, inst in ready["instances"].items():
        with urllib.request.urlopen(inst["metrics"], timeout=10) as resp:
            text = resp.read().decode()
        out[name] = {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines())
                     if k.startswith(METRICS)}
    return out


def delta(before: dict, after: dict, key: str, instances: str = "") -> float:
    """The change of every series starting with `key` (any labels), over the named instances."""
    return sum(v - before[n].get(k, 0.0) for n in after if n.startswith(instances)
               for k, v in after[n].items() if k.startswith(key))


class Cluster:
    def __init__(self, mode: str, ready: dict) -> None:
        from pdcluster.cluster.bench.backend import BackendConfig
        from pdcluster.cluster.bench.openai_backend import OpenAIBackend

        self.mode, self.ready = mode, ready
        self.backend = OpenAIBackend(BackendConfig("openai-chat", ready["http"] + "/v1/chat/completions",
                                                   ignore_eos=True), chat=True)


class Requests:
    """Fresh texts (32 random words: no prefix-cache hit between requests) and fresh 224x224 JPEG
    noise images (cluster/bench/random_mm.py's, as `bench serve --dataset-name random-mm` sends)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def images(self, n: int) -> tuple[bytes, ...]:
        from pdcluster.cluster.bench.random_mm import random_image

        return tuple(random_image(self.rng, 224, 224) for _ in range(n))

    def request(self, images: tuple[bytes, ...]) -> Any:
        from pdcluster.cluster.bench.request import BenchRequest

        text = " ".join(f"t{i}" for i in self.rng.integers(3, 383, size=32))
        return BenchRequest(text, 32, 4, images=images)


async def measure(c: Cluster, reqs: Requests, n: int) -> dict[str, Any]:
    images = reqs.images(n)
    if c.mode != "local":  # encode-0 computes and holds them; prefill-0 fetches them
        warm = await c.backend.request(reqs.request(images))
        if not warm.success:
            return {"ok": False, "why": f"warm-up: {warm.error}"}
    before = await asyncio.to_thread(scrape, c.ready)
    r = await c.backend.request(reqs.request(images))
    after = await asyncio.to_thread(scrape, c.ready)
    computed = delta(before, after, 'pdcluster_mm_items_total{source="computed"}')
    remote = delta(before, after, 'pdcluster_mm_items_total{source="remote"}', "prefill")
    row = {"ok": r.success, "ttft_s": r.ttft, "bytes": delta(before, after, "pdcluster_ec_transfer_bytes_total"),
           "computed": computed, "remote": remote, "error": r.error}
    want = (computed == n) if c.mode == "local" else (computed == 0 and remote == n)
    if r.success and not want:
        row.update(ok=False, why=f"computed {computed:g}, remote {remote:g} (expected the {c.mode} path)")
    return row


def tower_timer(model: str) -> Any:
    """The tower + projector on fresh images in this process (encoder-only engine, cache off)."""
    from pdcluster import AsyncEngine
    from pdcluster.config import EngineArgs

    engine = AsyncEngine.from_engine_args(EngineArgs(model=model, device="cpu", encoder_only=True,
                                                     encoder_cache_bytes=0))

    def timed(images: tuple[bytes, ...]) -> float:
        features = engine.engine.prepare_encode(list(images))
        t0 = time.perf_counter()
        engine.engine.core.runner.mm.encode_features(features)
        return time.perf_counter() - t0

    return engine, timed


def fmt(xs: list[float], scale: float = 1e3) -> str:
    return f"{statistics.median(xs) * scale:8.1f}" if xs else "       -"


async def run(clusters: list[Cluster], model: str, counts: list[int], repeats: int) -> dict[str, Any]:
    reqs = Requests(0)
    engine, timed = tower_timer(model)
    rows: dict[tuple[str, int], list[dict]] = {(c.mode, n): [] for c in clusters for n in counts}
    tower: dict[int, list[float]] = {n: [] for n in counts}
    try:
        for c in clusters:
            await c.backend.start()
        for rnd in range(repeats + 1):  # round 0 warms every path up and is not recorded
            for n in counts:
                order = clusters[rnd % len(clusters):] + clusters[:rnd % len(clusters)]
                for c in order:
                    row = await measure(c, reqs, n)
                    if rnd:
                        rows[(c.mode, n)].append(row)
                    if not row["ok"]:
                        print(f"  round {rnd} {c.mode} images={n}: left out: {row.get('why') or row['error']}",
                              flush=True)
                t = timed(reqs.images(n))
                if rnd:
                    tower[n].append(t)
    finally:
        for c in clusters:
            await c.backend.close()
        engine.shutdown()
    return {"rows": rows, "tower": tower}


def report(res: dict[str, Any], counts: list[int]) -> list[dict[str, Any]]:
    out = []
    print("\nmode     images  ok/n   TTFT median ms  p25..p75 ms       bytes/request  tower alone ms (median)")
    for n in counts:
        for mode in MODES:
            rows = res["rows"].get((mode, n))
            if rows is None:
                continue
            good = [r for r in rows if r["ok"]]
            ttft = sorted(r["ttft_s"] for r in good)
            q = statistics.quantiles(ttft, n=4) if len(ttft) >= 2 else ttft * 3
            nbytes = statistics.median(r["bytes"] for r in good) if good else 0
            print(f"{mode:8s} {n:6d}  {len(good)}/{len(rows)}  {fmt(ttft)}        {q[0] * 1e3:7.1f}..{q[-1] * 1e3:7.1f}"
                  f"  {nbytes / 1e6:9.2f} MB     {fmt(res['tower'][n])}", flush=True)
            out.append({"mode": mode, "images": n, "ok": len(good), "n": len(rows),
                        "median_ttft_ms": statistics.median(ttft) * 1e3 if ttft else None,
                        "ttft_ms": [t * 1e3 for t in ttft], "median_bytes": nbytes,
                        "tower_median_ms": statistics.median(res["tower"][n]) * 1e3})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", default="1,4")
    p.add_argument("--repeats", type=int, default=5, help="measured requests per (mode, images); medians")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads of every worker and of the tower timer (OMP_NUM_THREADS and "
                        "PDCLUSTER_NUM_THREADS); 0: torch's default (one per core)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads:  # before torch is imported here; the serve processes inherit it
        os.environ["OMP_NUM_THREADS"] = os.environ["PDCLUSTER_NUM_THREADS"] = str(args.threads)
    counts = [int(x) for x in args.images.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    from throughput import cpu_path

    print(cpu_path("float32"), f"load average {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ec-ttft-") as tmp:
        model = make_checkpoint(f"{tmp}/llava", 12, 2048)
        with open(f"{model}/chat_template.jinja", "w") as f:
            f.write(TEMPLATE)
        procs = {m: start(model, m) for m in modes}  # start side by side, then wait for each
        try:
            t0 = time.perf_counter()
            clusters = [Cluster(m, wait_ready(procs[m])) for m in modes]
            print(f"clusters ready in {time.perf_counter() - t0:.0f} s", flush=True)
            res = asyncio.run(run(clusters, model, counts, args.repeats))
        finally:
            for proc in procs.values():
                stop(proc)
    table = report(res, counts)
    print(f"load average {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"repeats": args.repeats, "threads": args.threads or "default", "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
