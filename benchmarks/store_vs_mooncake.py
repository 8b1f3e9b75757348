"""kvstore vs Mooncake Store, put/get side by side in interleaved rounds (issue 14's store target).

    PDCLUSTER_KVSTORE_OBJECT_KEY=<64 hex> python benchmarks/store_vs_mooncake.py \
        [--total-mib 32] [--sizes 16,64,256,1024,4096] [--repeats 5] [--json out.json]

Same store processes as `pdcluster bench transfer --connector store` (cluster/bench/store_transfer.py:
`pdcluster kvstore master|node`, mooncake_master + a storage process, all on 127.0.0.1), same
backend objects as the store connector, batches of --batch objects per call. The difference is
the timing: per object size, one warm-up, then --repeats rounds, each running every backend's put
then get in turn, so a shared machine's load swings hit all of them alike; reported are the
median GB/s and the median CPU seconds per GB of this (the client) process, and of the client
plus that backend's own store processes (`sys`: master and storage node; on a shared machine
wall throughput tends to share-of-cores / CPU per byte), and the median of the per-round
kvstore/Mooncake ratios (`paired`: the two ran seconds apart in each round). With the object key
set (the default deployment, issue 16 item 6) every kvstore object is MACed at put and checked on
every get; Mooncake has no such check. kvstore_tcp is the kvstore's remote-node path (no shared
memory) for reference; kvstore_grpc is the same-host kvstore with its master's lookup socket off
(`--no-lookup-socket`: every GetReplicas over gRPC, kvstore/lookup_socket.py), for a paired
before/after of that path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from pdcluster.cluster.bench.store_transfer import REUSE_WAIT_S


def _proc_cpu_s(pids: list[int]) -> float:
    """utime + stime of these processes (Linux /proc), seconds; 0 where unreadable."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def _rounds(backend: Any, src: Any, dst: Any, size: int, batch: int, repeats: int, tag: str,
            stats: dict[str, list[tuple[float, ...]]], pids: list[int]) -> Any:
    """A generator: each next() runs one put round then one get round of `backend`."""
    import torch

    n = src.nbytes // size
    s_rows = list(torch.from_numpy(src).view(n, size).unbind(0))
    d_rows = list(torch.from_numpy(dst).view(n, size).unbind(0))
    for r in range(repeats + 1):
        keys = [f"svm-{tag}-{size}-{r}-{i}" for i in range(n)]
        for op in ("put", "get"):
            c, t, sc = time.process_time(), time.perf_counter(), _proc_cpu_s(pids)
            for a in range(0, n, batch):
                if op == "put":
                    ok = backend.batch_put_from(keys[a:a + batch], s_rows[a:a + batch])
                    assert all(x.name == "STORED" for x in ok), f"{tag} put failed: {ok[:2]}"
                else:
                    assert all(backend.batch_get_into(keys[a:a + batch], d_rows[a:a + batch])), f"{tag} get failed"
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            server_cpu = _proc_cpu_s(pids) - sc  # the store processes, at clock-tick resolution
            if r:  # round 0 is the warm-up
                gb = src.nbytes / 1e9
                stats[f"{tag}_{op}"].append((src.nbytes / wall / 1e9, cpu / gb, (cpu + server_cpu) / gb))
        assert bytes(dst[:size]) == bytes(src[:size]), f"{tag}: bytes read back differ"
        backend.remove(keys)
        yield


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-mib", type=int, default=32)
    p.add_argument("--sizes", default="16,64,256,1024,4096", help="object sizes, KiB")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", default="kvstore,mooncake,kvstore_tcp", help="run in this order in every round")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import numpy as np
    import torch

    from pdcluster.cluster.store_procs import LocalStores
    from pdcluster.connectors.store.backend_factory import make_backend
    from pdcluster.connectors.store.mooncake_backend import mooncake_available
    from pdcluster.kvstore.object_mac import store_key_from_env

    total = args.total_mib << 20
    wanted = args.backends.split(",")
    src = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    rows = []
    with LocalStores(tempfile.mkdtemp(prefix="svm-")) as stores:
        backends: dict[str, Any] = {}
        pids: dict[str, list[int]] = {}  # each backend's store processes

        def started_since(n: int) -> list[int]:
            return [proc.pid for proc in stores.started[n:]]

        for name, use_shm, extra in (("kvstore", True, ()), ("kvstore_grpc", True, ("--no-lookup-socket",)),
                                     ("kvstore_tcp", False, ())):
            if name in wanted:
                n0 = len(stores.started)
                master = stores.kvstore(node_size=f"{16 * args.total_mib}M", master_args=(
                    "--lease-ttl-s", "0.5", "--grace-s", "0.1", "--put-timeout-s", "0.5", *extra))
                backends[name] = make_backend("kvstore", {"master": master, "use_shm": use_shm})
                pids[name] = started_since(n0)
        if "mooncake" in wanted:
            why = mooncake_available()
            if why is not None:
                print(f"skipping mooncake: {why}", file=sys.stderr)
            else:
                n0 = len(stores.started)
                backends["mooncake"] = make_backend("mooncake", {"mooncake_master": stores.mooncake(
                    segment_bytes=16 * total)})
                pids["mooncake"] = started_since(n0)
        backends = {n: backends[n] for n in wanted if n in backends}  # each round runs them in --backends order
        for b in backends.values():
            b.register_buffer(torch.from_numpy(src))
            b.register_buffer(torch.from_numpy(dst))
        for kib in (int(s) for s in args.sizes.split(",")):
            stats: dict[str, list[tuple[float, ...]]] = {f"{n}_{op}": [] for n in backends for op in ("put", "get")}
            gens = [_rounds(b, src, dst, kib << 10, args.batch, args.repeats, n, stats, pids[n])
                    for n, b in backends.items()]
            for _ in range(args.repeats + 1):
                for g in gens:
                    next(g)
                time.sleep(REUSE_WAIT_S)  # untimed: removed objects' space becomes reusable
            row: dict[str, Any] = {"size_kib": kib}
            for k, v in stats.items():
                row[k] = statistics.median(x[0] for x in v)
                row[k + "_cpu_s_per_gb"] = statistics.median(x[1] for x in v)
                row[k + "_sys_cpu_s_per_gb"] = statistics.median(x[2] for x in v)
            for op in ("put", "get"):  # per round, kvstore and Mooncake ran seconds apart: a paired ratio
                for other in ("mooncake", "kvstore_grpc"):  # cancels slower load swings
                    if "kvstore" in backends and other in backends:
                        tag = "" if other == "mooncake" else "_vs_grpc"
                        row[f"{op}_ratio_paired{tag}"] = statistics.median(
                            a[0] / b[0] for a, b in zip(stats[f"kvstore_{op}"], stats[f"{other}_{op}"], strict=True))
                for n in backends:  # every kvstore variant against Mooncake, for the JSON
                    if n != "mooncake" and "mooncake" in backends:
                        row[f"{n}_{op}_paired_vs_mooncake"] = statistics.median(
                            a[0] / b[0] for a, b in zip(stats[f"{n}_{op}"], stats[f"mooncake_{op}"], strict=True))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        for n, b in backends.items():
            lookups = getattr(getattr(b, "_client", None), "lookup_counters", None)
            if lookups:  # which path the gets took (kvstore/lookup_client.py)
                print(f"{n}: {lookups}", file=sys.stderr)
            b.close()
    names = list(backends)
    print(f"object key (kvstore MAC): {'on' if store_key_from_env() else 'off'}; median of {args.repeats} "
          f"interleaved rounds, {args.total_mib} MiB per figure, batch {args.batch}; GB/s (client CPU s/GB; "
          "client + store processes CPU s/GB)")
    print("| object | " + " | ".join(f"{n} put | {n} get" for n in names) + " | get kvstore/mooncake | paired: get, put | get CPU mooncake/kvstore |")
    print("|---" * (2 * len(names) + 4) + "|")
    for r in rows:
        cells = " | ".join(f"{r[f'{n}_{op}']:.2f} ({r[f'{n}_{op}_cpu_s_per_gb']:.2f}; "
                           f"{r[f'{n}_{op}_sys_cpu_s_per_gb']:.2f})" for n in names for op in ("put", "get"))
        both = "kvstore" in names and "mooncake" in names
        ratio = f"{r['kvstore_get'] / r['mooncake_get']:.2f}" if both else "-"
        paired = f"{r['get_ratio_paired']:.2f}, {r['put_ratio_paired']:.2f}" if both else "-"
        cpu_ratio = (f"{r['mooncake_get_sys_cpu_s_per_gb'] / max(r['kvstore_get_sys_cpu_s_per_gb'], 1e-9):.2f}"
                     if both else "-")  # > 1: kvstore needs less CPU per byte (client + store processes)
        print(f"| {r['size_kib']} KiB | {cells} | {ratio} | {paired} | {cpu_ratio} |")
    if "kvstore_grpc" in names and "kvstore" in names:
        print("paired get kvstore (lookup socket) / kvstore_grpc (--no-lookup-socket): "
              + ", ".join(f"{r['size_kib']} KiB {r['get_ratio_paired_vs_grpc']:.2f}" for r in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
