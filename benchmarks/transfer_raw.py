"""Data-plane throughput vs a raw socket and vs memcpy, for block sizes 16 KiB .. 1 MiB.

    .venv/bin/python benchmarks/transfer_raw.py [--total-mib 64] [--json out.json]

A child process (this script with --serve) owns a shared-memory region and serves it two ways:
our TransferServer, and a bare TCP loop that `sendall`s blocks straight from the region (the
floor any TCP protocol pays). The parent reads TOTAL bytes in blocks of each size:

  memcpy         numpy copyto, block by block, inside one process
  shm            map the child's segment (same host path) and copy block by block
  raw_tcp        one connection, sendall / recv_into of the same blocks (no protocol)
  xfer_1req/blk  TransferClient: one token + request per block (per-request overhead)
  xfer_batch_sN  TransferClient: one request with every block as a range, N streams
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np

from pdcluster.transfer import (
    OP_READ,
    SharedRegionCache,
    TransferClient,
    TransferServer,
    alloc_region,
    issue_token,
)
from pdcluster.transfer.protocol import recv_exact

BLOCKS = [16 << 10, 64 << 10, 256 << 10, 1 << 20]
RAW_REQ = struct.Struct("!QQ")  # block size, count


def serve(total: int) -> None:
    region = alloc_region(total, shared=True)
    region.as_numpy()[:] = 7
    server = TransferServer(bytes.fromhex(os.environ["BENCH_KEY"])).start()
    region_id = server.register(region)
    raw = socket.create_server(("127.0.0.1", 0))

    def raw_loop() -> None:
        while True:
            conn, _ = raw.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                req = memoryview(bytearray(RAW_REQ.size))
                while True:
                    try:
                        recv_exact(conn, req)
                    except ConnectionError:
                        break
                    block, count = RAW_REQ.unpack(req)
                    for i in range(count):
                        conn.sendall(region.view[(i * block) % total:(i * block) % total + block])

    threading.Thread(target=raw_loop, daemon=True).start()
    print(json.dumps({"port": server.address[1], "raw_port": raw.getsockname()[1], "region_id": region_id,
                      "shm": region.shm_name}), flush=True)
    sys.stdin.read()
    server.stop()
    region.close()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(fn, nbytes: int, repeat: int = 3) -> float:
    fn()  # warm up (connections, page faults)
    best = min(_once(fn) for _ in range(repeat))
    return gbps(nbytes, best)


def _once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_block(block: int, ctx: dict) -> dict:
    """Every method on one block size; closures bind this call's locals."""
    addr, region_id, key, total = ctx["addr"], ctx["region_id"], ctx["key"], ctx["total"]
    src, dst, seg, raw = ctx["src"], ctx["dst"], ctx["seg"], ctx["raw"]
    dview = memoryview(dst)
    n = total // block
    ranges = [(i * block, block) for i in range(n)]
    tokens = [issue_token(key, secrets.token_bytes(16), OP_READ, region_id, [r], ttl_s=600) for r in ranges]
    batch_tok = issue_token(key, secrets.token_bytes(16), OP_READ, region_id, ranges, ttl_s=600)
    c1 = TransferClient(num_streams=1)
    c4 = TransferClient(num_streams=4, min_stream_bytes=1 << 20)

    def memcpy() -> None:
        for o, b in ranges:
            np.copyto(dst[o:o + b], src[o:o + b])

    def shm_copy() -> None:
        for o, b in ranges:
            dview[o:o + b] = seg.view[o:o + b]

    def raw_tcp() -> None:
        raw.sendall(RAW_REQ.pack(block, n))
        for o, b in ranges:
            recv_exact(raw, dview[o:o + b])

    def per_block() -> None:
        for (o, b), t in zip(ranges, tokens, strict=True):
            c1.read(addr, t, [(o, b)], dview[o:o + b])

    row = {"block_bytes": block, "memcpy": timed(memcpy, total), "shm": timed(shm_copy, total),
           "raw_tcp": timed(raw_tcp, total), "xfer_1req_per_block": timed(per_block, total),
           "xfer_batch_s1": timed(lambda: c1.read(addr, batch_tok, ranges, dst), total),
           "xfer_batch_s4": timed(lambda: c4.read(addr, batch_tok, ranges, dst), total)}
    assert dst.min() == 7
    c1.close()
    c4.close()
    return row


def bench(info: dict, key: bytes, total: int) -> list[dict]:
    shm = SharedRegionCache()
    raw = socket.create_connection(("127.0.0.1", info["raw_port"]))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ctx = {"addr": ("127.0.0.1", info["port"]), "region_id": info["region_id"], "key": key, "total": total,
           "src": np.full(total, 7, dtype=np.uint8), "dst": np.zeros(total, dtype=np.uint8),
           "seg": shm.get(info["shm"], total, writable=False), "raw": raw}
    rows = []
    for block in BLOCKS:
        row = bench_block(block, ctx)
        rows.append(row)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v >> 10}KiB" for k, v in row.items()),
              flush=True)
    raw.close()
    del ctx
    shm.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--total-mib", type=int, default=64)
    p.add_argument("--json", default=None, help="write the results (GB/s) here")
    args = p.parse_args()
    total = args.total_mib << 20
    if args.serve:
        serve(total)
        return
    key = secrets.token_bytes(32)
    child = subprocess.Popen([sys.executable, __file__, "--serve", "--total-mib", str(args.total_mib)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "BENCH_KEY": key.hex()})
    try:
        rows = bench(json.loads(child.stdout.readline()), key, total)
    finally:
        child.stdin.close()
        child.wait(30)
    print("GB/s; cores:", os.cpu_count())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"unit": "GB/s", "total_bytes": total, "cpu_count": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
