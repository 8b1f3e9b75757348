"""CPU seconds per GB, per side, of the P2P data plane's scattered READ: raw TCP vs ScatterReader
with no MAC, AES-GMAC (the default) and keyed BLAKE3.

    .venv/bin/python benchmarks/transfer_cpu.py [--block-kib 64 1024] [--rounds 5] [--streams 4]
                                                [--methods raw,nomac,gmac,blake3]

A child process (this script with --serve) owns a 128 MiB region and serves it through a
TransferServer and through a bare TCP loop that `sendall`s blocks (the floor of any TCP
protocol). This process reads all of it per round, in scattered blocks (random permutations on
both sides), with each method in turn (one warm-up round), and reports per method the median
GB/s and `time.process_time()` CPU seconds per GB of this process (consumer) and of the child
(producer, asked over its pipe). No loader, control plane or leases: the data plane alone.
On a machine whose cores are all busy, wall time is CPU per byte over the share of the cores we
get, so these CPU figures are the steadier ones to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

KEY = b"k" * 32
TOTAL = 128 << 20
_RAW = struct.Struct("!QQ")  # block bytes, block count


def _serve() -> None:
    from pdcluster.transfer import TransferServer, alloc_region
    from pdcluster.transfer.protocol import recv_exact

    region = alloc_region(TOTAL, shared=False)
    region.as_numpy()[:] = 7
    srv = TransferServer(KEY).start()
    rid = srv.register(region)
    raw = socket.create_server(("127.0.0.1", 0))

    def raw_loop() -> None:
        conn, _ = raw.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        req = memoryview(bytearray(_RAW.size))
        while True:
            try:
                recv_exact(conn, req)
            except (ConnectionError, OSError):
                return
            block, count = _RAW.unpack(req)
            for i in range(count):
                conn.sendall(region.view[i * block:(i + 1) * block])

    threading.Thread(target=raw_loop, daemon=True).start()
    print(json.dumps({"port": srv.address[1], "rid": rid, "raw": raw.getsockname()[1]}), flush=True)
    for _ in sys.stdin:  # one line in, this process's CPU seconds out
        print(json.dumps({"cpu": time.process_time()}), flush=True)
    srv.stop()


def _measure(block: int, rounds: int, streams: int, methods: list[str]) -> dict[str, dict[str, float]]:
    import numpy as np

    from pdcluster.connectors.p2p.scatter_reader import ScatterReader
    from pdcluster.transfer import OP_READ, issue_token
    from pdcluster.transfer.integrity import transfer_mac_key
    from pdcluster.transfer.protocol import recv_exact

    nb = TOTAL // block
    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdin is not None and child.stdout is not None
    info = json.loads(child.stdout.readline())

    def child_cpu() -> float:
        child.stdin.write("x\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())["cpu"]

    dst = np.zeros(TOTAL, np.uint8)
    dv = memoryview(dst)
    rng = random.Random(1)
    readers = {m: ScatterReader(num_streams=streams, min_stream_bytes=1 << 20, io_timeout_s=60,
                                mac="blake3" if m == "blake3" else "gmac") for m in methods if m != "raw"}
    raw = socket.create_connection(("127.0.0.1", info["raw"]))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    samples: dict[str, list[tuple[float, float, float]]] = {m: [] for m in methods}
    try:
        for r in range(rounds + 1):
            for m in methods:
                src = [(b * block, block) for b in rng.sample(range(nb), nb)]
                dsts = [(b * block, block) for b in rng.sample(range(nb), nb)]
                p0, c0, t0 = child_cpu(), time.process_time(), time.perf_counter()
                if m == "raw":
                    raw.sendall(_RAW.pack(block, nb))
                    for off, n in dsts:
                        recv_exact(raw, dv[off:off + n])
                else:
                    token = issue_token(KEY, os.urandom(16), OP_READ, info["rid"], src, ttl_s=60)
                    mac_key = None if m == "nomac" else transfer_mac_key(KEY, token)
                    readers[m].read(("127.0.0.1", info["port"]), token, src, dv, dsts, mac_key)
                wall, c1 = time.perf_counter() - t0, time.process_time()
                p1 = child_cpu()
                if r:  # round 0 warms up connections and page faults
                    gb = TOTAL / 1e9
                    samples[m].append((gb / wall, (c1 - c0) / gb, (p1 - p0) / gb))
    finally:
        for rd in readers.values():
            rd.close()
        raw.close()
        child.stdin.close()
        child.wait(30)
    return {m: {"gbps": statistics.median(x[0] for x in s), "consumer_cpu_s_per_gb": statistics.median(x[1] for x in s),
                "producer_cpu_s_per_gb": statistics.median(x[2] for x in s)} for m, s in samples.items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        _serve()
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-kib", type=int, nargs="+", default=[64, 256, 1024, 4096])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--methods", default="raw,nomac,gmac,blake3")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = {}
    print(f"{'block':>8} {'method':>7} {'GB/s':>6} {'consumer':>9} {'producer':>9} {'sum':>6}  (CPU s/GB, medians)")
    for kib in args.block_kib:
        res = _measure(kib << 10, args.rounds, args.streams, args.methods.split(","))
        out[kib] = res
        for m, v in res.items():
            c, q = v["consumer_cpu_s_per_gb"], v["producer_cpu_s_per_gb"]
            print(f"{kib:>5}KiB {m:>7} {v['gbps']:6.2f} {c:9.3f} {q:9.3f} {c + q:6.3f}", flush=True)
    print(f"load average {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
