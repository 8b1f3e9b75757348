"""KV store benchmark: object put/get throughput next to raw TCP and memcpy, and prefix reuse.

    python -m pdcluster.cluster.bench.store_transfer [--total-mib 64] [--json out.json]

1. Throughput, per object size (16 KiB .. 4 MiB), between this process and store processes on
   127.0.0.1 started here (`pdcluster kvstore master|node`; mooncake_master + a storage process):

     memcpy          numpy copy inside this process (the ceiling)
     raw_tcp         a bare TCP stream to a child process, sendall/recv_into (the floor of any
                     TCP protocol): put = we send, get = we receive
     kvstore         the built-in store as the connector uses it: batch_put_from / batch_get_into of
                     --batch objects per call; same-host node, so bytes go through shared memory
     kvstore_tcp     the same over its TCP data plane (use_shm off: a remote node's path)
     mooncake        Mooncake Store (if installed): registered buffers, TCP transfer engine

2. Prefix reuse (store_prefix.py): requests sharing long prefixes spread over two engine
   instances, with the store connector and without: prefix hit rate and TTFT.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy is imported where used: `pdcluster --help` registers these flags
    import numpy as np

SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
_RAW = struct.Struct("!BQQ")  # op (0 get, 1 put), object size, count
# The kvstore master runs with 0.5 s write tokens and 0.1 s grace here: removed objects' bytes are
# reusable after this long, so one store a few times the working set serves every run.
REUSE_WAIT_S = 0.8


def add_store_bench_args(p: argparse.ArgumentParser, shared: bool = False) -> None:
    """shared: added to `bench transfer`, which already has --total-mib."""
    if not shared:
        p.add_argument("--total-mib", type=int, default=64, help="bytes moved per object size and method")
    p.add_argument("--sizes", default=",".join(str(s >> 10) for s in SIZES), help="object sizes in KiB")
    p.add_argument("--batch", type=int, default=16, help="objects per batch_put_from / batch_get_into call")
    p.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is reported")
    p.add_argument("--statistic", choices=("best", "median"), default="best",
                   help="which of the --repeat runs a figure reports")
    p.add_argument("--backends", default="kvstore,kvstore_tcp,mooncake")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-prefix", action="store_true")
    p.add_argument("--prefix-model", default="bench", help="'bench' (a generated ~90M-parameter Llama), "
                                                            "'demo', or a local HF directory")
    p.add_argument("--num-prefixes", type=int, default=3)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--workdir", default=None, help="logs of the store processes (default: a temp dir)")


# -- raw TCP baseline (child process) ------------------------------------------------------------
def _serve_raw() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(max(SIZES) * 4)
    view = memoryview(buf)
    head = bytearray(_RAW.size)
    while conn.recv_into(head, _RAW.size, socket.MSG_WAITALL) == _RAW.size:
        op, size, count = _RAW.unpack(head)
        for _ in range(count):
            if op == 0:
                conn.sendall(view[:size])
            else:
                _recv_exact(conn, view[:size])
        if op == 1:
            conn.sendall(b"k")  # the put is complete only when the peer holds every byte


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            raise ConnectionError("peer closed")
        got += n


class _RawPeer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pdcluster.cluster.bench.store_transfer", "--serve-raw"], stdout=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True)
        port = json.loads(self.proc.stdout.readline())["port"]  # type: ignore[union-attr]
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def run(self, op: int, src: np.ndarray, size: int) -> None:
        n = src.nbytes // size
        self.sock.sendall(_RAW.pack(op, size, n))
        view = memoryview(src)
        for i in range(n):
            if op == 0:
                _recv_exact(self.sock, view[i * size:(i + 1) * size])
            else:
                self.sock.sendall(view[i * size:(i + 1) * size])
        if op == 1:
            _recv_exact(self.sock, memoryview(bytearray(1)))

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)


# -- timing -------------------------------------------------------------------------------------
def _best_gbps(fn: Callable[[], None], nbytes: int, repeat: int, before: Callable[[], None] | None = None,
               statistic: str = "best") -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return nbytes / (min(times) if statistic == "best" else statistics.median(times)) / 1e9


def _store_rows(backend: Any, src: np.ndarray, dst: np.ndarray, size: int, batch: int, repeat: int,
                tag: str, statistic: str = "best") -> tuple[float, float]:
    import numpy as np
    import torch

    n = src.nbytes // size
    s_rows = list(torch.from_numpy(src).view(n, size).unbind(0))
    d_rows = list(torch.from_numpy(dst).view(n, size).unbind(0))
    run = [0]

    def keys() -> list[str]:
        return [f"bench-{tag}-{size}-{run[0]}-{i}" for i in range(n)]

    def put() -> None:
        ks = keys()
        for a in range(0, n, batch):
            ok = backend.batch_put_from(ks[a:a + batch], s_rows[a:a + batch])
            assert all(r.name == "STORED" for r in ok), f"{tag} put failed: {ok[:4]}"

    def get() -> None:
        ks = keys()
        for a in range(0, n, batch):
            assert all(backend.batch_get_into(ks[a:a + batch], d_rows[a:a + batch])), f"{tag} get failed"

    def fresh() -> None:  # each put run writes new keys: the old ones are removed to free space
        if run[0]:
            backend.remove(keys())
            time.sleep(REUSE_WAIT_S)  # untimed: let the store reclaim that space
        run[0] += 1

    put_gbps = _best_gbps(put, src.nbytes, repeat, before=fresh, statistic=statistic)
    get_gbps = _best_gbps(get, src.nbytes, repeat, statistic=statistic)
    assert np.array_equal(dst, src), f"{tag}: bytes read back differ"
    backend.remove(keys())
    time.sleep(REUSE_WAIT_S)
    return put_gbps, get_gbps


def _warm(backends: dict[str, Any], src: np.ndarray, generations: int) -> None:
    """Touch each store's memory once, as a long-running store's is: the first write to a fresh
    segment page-faults (the kernel zero-fills shared pages), which is not the store's steady cost.
    Then remove the objects and wait until their space is reusable again (write-token expiry)."""
    import torch

    size = 4 << 20
    rows = list(torch.from_numpy(src[: src.nbytes // size * size]).view(-1, size).unbind(0))
    for name, b in backends.items():
        b.register_buffer(torch.from_numpy(src))
        keys = [f"warm-{name}-{g}-{i}" for g in range(generations) for i in range(len(rows))]
        for a in range(0, len(keys), len(rows)):
            b.batch_put_from(keys[a:a + len(rows)], rows)
        b.remove(keys)
        b.unregister_buffer(torch.from_numpy(src))
    time.sleep(REUSE_WAIT_S)


def run_throughput(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    import numpy as np

    from pdcluster.cluster.store_procs import LocalStores
    from pdcluster.connectors.store.backend_factory import make_backend
    from pdcluster.connectors.store.mooncake_backend import mooncake_available

    total = args.total_mib << 20
    sizes = [int(s) << 10 for s in args.sizes.split(",")]
    wanted = args.backends.split(",")
    src = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    rows = [{"size": s} for s in sizes]
    for row in rows:
        row["memcpy"] = _best_gbps(lambda: np.copyto(dst, src), total, args.repeat, statistic=args.statistic)
    raw = _RawPeer()
    try:
        for row in rows:
            row["raw_tcp_put"] = _best_gbps(lambda s=row["size"]: raw.run(1, src, s), total, args.repeat,
                                            statistic=args.statistic)
            row["raw_tcp_get"] = _best_gbps(lambda s=row["size"]: raw.run(0, dst, s), total, args.repeat,
                                            statistic=args.statistic)
    finally:
        raw.close()
    with LocalStores(workdir) as stores:
        backends: dict[str, Any] = {}
        for name, use_shm in (("kvstore", True), ("kvstore_tcp", False)):
            if name in wanted:
                # Removed objects' bytes are reused only once their write tokens expired: short
                # timeouts, a store per variant and room for a few generations keep eviction out.
                master = stores.kvstore(node_size=f"{8 * args.total_mib}M", master_args=(
                    "--lease-ttl-s", "0.5", "--grace-s", "0.1", "--put-timeout-s", "0.5"))
                backends[name] = make_backend("kvstore", {"master": master, "use_shm": use_shm})
        if "mooncake" in wanted:
            why = mooncake_available()
            if why is None:
                mc = stores.mooncake(segment_bytes=8 * total)
                backends["mooncake"] = make_backend("mooncake", {"mooncake_master": mc})
            else:
                print(f"skipping mooncake: {why}", file=sys.stderr)
        import torch

        if backends:
            _warm(backends, src, 7)
        for name, b in backends.items():
            b.register_buffer(torch.from_numpy(src))
            b.register_buffer(torch.from_numpy(dst))
            for row in rows:
                dst[:] = 0
                row[f"{name}_put"], row[f"{name}_get"] = _store_rows(b, src, dst, row["size"], args.batch,
                                                                     args.repeat, name, args.statistic)
                print(f"  {name} {row['size'] >> 10} KiB: put {row[f'{name}_put']:.2f} GB/s, "
                      f"get {row[f'{name}_get']:.2f} GB/s", file=sys.stderr, flush=True)
        for b in backends.values():
            b.close()
    return rows


def throughput_table(rows: list[dict[str, Any]]) -> str:
    cols = [c for c in rows[0] if c != "size"]
    out = ["| object | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        size = f"{r['size'] >> 10} KiB" if r["size"] < (1 << 20) else f"{r['size'] >> 20} MiB"
        out.append(f"| {size} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
    return "\n".join(out)


def run_store_bench(args: argparse.Namespace) -> int:
    workdir = args.workdir or tempfile.mkdtemp(prefix="store-bench-")
    result: dict[str, Any] = {"workdir": workdir}
    if not args.skip_throughput:
        rows = run_throughput(args, workdir)
        result["throughput_gbps"] = rows
        print(f"\nThroughput (GB/s, {args.statistic} of {args.repeat}, {args.total_mib} MiB per figure, "
              f"batch {args.batch}):\n")
        print(throughput_table(rows))
    if not args.skip_prefix:
        from pdcluster.cluster.bench.store_prefix import prefix_table, run_prefix_reuse

        result["prefix_reuse"] = run_prefix_reuse(args, workdir)
        print("\nPrefix reuse across two instances:\n")
        print(prefix_table(result["prefix_reuse"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-raw"]:
        threading.excepthook = lambda *_: None
        _serve_raw()
        return 0
    p = argparse.ArgumentParser(prog="store_transfer", description=__doc__.splitlines()[0])
    add_store_bench_args(p)
    return run_store_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
