"""Storage node: owns memory segments, serves them on the data plane, registers them with the master.

    python -m pdcluster.kvstore.node --master 127.0.0.1:50070 --size 1G --secret-file kv.secret

The node is passive on the data path: clients READ/WRITE its segments with tokens the master
minted (verified here with the node's derived key), or map them directly when on the same host.
It heartbeats the master; when the master answers UNKNOWN_NODE (a restarted master that lost
track, or a node it had declared dead) it mounts its segments again. Segments get a random
incarnation per allocation, so a restarted node never inherits placements on memory it lost.

Runs standalone (`run_node`) or inside another process (`StorageNode(...).start()`). With
`--metrics-port` it serves Prometheus /metrics (kvstore/metrics.py NodeCollector) on
`--metrics-host`, loopback by default.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import secrets
import signal
import socket
import sys
import threading
from collections import Counter
from typing import Any

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster.transfer import OP_READ, Capability, Region, TransferServer, alloc_region, local_host_id

from .entities import Status
from .master_rpc import KVStoreError, MasterRPC
from .metrics import NodeCollector, serve_collectors
from .rpc import add_tls_client_args
from .secret import load_secret, node_key

log = logging.getLogger(__name__)
UNMOUNT_BUDGET_S = 1.0  # stop(): how long the unmount may look for a master (failover included)


class StorageNode:
    def __init__(self, master_addr: str, secret: bytes, segment_sizes: list[int], *, node_id: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None, shared: bool = True,
                 heartbeat_s: float = 1.0, rpc_timeout_s: float = 5.0, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, metrics_host: str = "127.0.0.1",
                 metrics_port: int | None = None) -> None:
        # metrics_port: serve /metrics there (0: any free port); None: no metrics endpoint
        if not segment_sizes or any(s <= 0 for s in segment_sizes):
            raise ValueError("need at least one positive segment size")
        self.node_id = node_id or f"{socket.gethostname()}-{os.getpid()}"
        self._sizes = segment_sizes
        self._shared = shared
        self._heartbeat_s = heartbeat_s
        self._timeout = rpc_timeout_s
        # master_addr: one address or "a,b" of a primary/standby pair: calls follow the primary
        self._master = MasterRPC(master_addr, timeout_s=rpc_timeout_s, tls_ca=tls_ca, tls_cert=tls_cert,
                                 tls_key=tls_key, failover_s=rpc_timeout_s)
        self._counters: Counter[str] = Counter()
        self._counters_lock = threading.Lock()
        self._reachable = False
        self._usage: tuple[int, int, int] | None = None  # (used bytes, objects, object bytes) the master reports
        # authorize: called once per request whose token verified; used only to count by op
        self.server = TransferServer(node_key(secret, self.node_id), host, port, authorize=self._admitted)
        bound = self.server.address[0]
        wildcard = bound in ("0.0.0.0", "::", "")
        self._advertise = advertise_host or (socket.getfqdn() if wildcard else bound)
        self.regions: dict[int, Region] = {}
        self._incarnations: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._metrics_addr = (metrics_host, metrics_port)
        self._httpd: Any = None
        self.metrics_port: int | None = None

    def _count(self, name: str) -> None:
        with self._counters_lock:
            self._counters[name] += 1

    def _admitted(self, cap: Capability) -> str | None:
        self._count("requests_read" if cap.op == OP_READ else "requests_write")
        return None  # never refuses: the token check already ran

    def stats(self) -> dict[str, Any]:
        """The node's counters and gauges (its /metrics): data plane (TransferServer) + heartbeats."""
        out: dict[str, Any] = dict(self.server.stats())
        with self._counters_lock:
            out.update(self._counters)
        out["segments"] = len(self.regions)
        out["capacity_bytes"] = sum(r.nbytes for r in self.regions.values())
        out["master_reachable"] = int(self._reachable)
        if self._usage is not None:
            out["used_bytes"], out["objects"], out["object_bytes"] = self._usage
        return out

    def _segments(self) -> list[pb.KVSegmentInfo]:
        return [pb.KVSegmentInfo(segment_id=sid, size=r.nbytes, shm_name=r.shm_name or "",
                                 incarnation=self._incarnations[sid]) for sid, r in self.regions.items()]

    def start(self, mount_timeout_s: float = 10.0) -> StorageNode:
        for i, size in enumerate(self._sizes, start=1):
            region = alloc_region(size, shared=self._shared)
            self.regions[self.server.register(region, i)] = region
            self._incarnations[i] = secrets.randbits(63)
        self.server.start()
        self._mount(wait_s=mount_timeout_s)
        self._reachable = True
        host, port = self._metrics_addr
        if port is not None:
            self._httpd, self.metrics_port = serve_collectors(host, port, NodeCollector(self.stats))
        self._thread = threading.Thread(target=self._heartbeat_loop, name="kvstore-node-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _mount(self, wait_s: float | None = None) -> None:
        req = pb.KVMountSegmentRequest(node_id=self.node_id, data_host=self._advertise,
                                       data_port=self.server.address[1], host_id=local_host_id(),
                                       segments=self._segments())
        resp = self._master.call("MountSegment", req, wait_s=wait_s)
        if resp.status != Status.OK:
            raise RuntimeError(f"master refused mount: {Status(resp.status).name}")
        log.info("node %s mounted %d segment(s)", self.node_id, len(self.regions))

    def _heartbeat_loop(self) -> None:
        failing = False
        while not self._stop.wait(self._heartbeat_s):
            try:
                # Bounded: a beat that finds no master gives up and the next one tries again (at
                # the next address), so stop() never waits out a whole failover for the thread.
                resp = self._master.call("Heartbeat", pb.KVHeartbeatRequest(node_id=self.node_id,
                                                                             segments=self._segments()),
                                         budget_s=max(1.0, 2 * self._heartbeat_s))
                self._count("heartbeats")
                if resp.HasField("used_bytes"):  # unset from a master that predates it
                    self._usage = (resp.used_bytes, resp.objects, resp.object_bytes)
                if resp.status == Status.UNKNOWN_NODE:
                    self._count("remounts")
                    self._mount()
                self._reachable = True
                if failing:
                    log.info("node %s: master reachable again", self.node_id)
                failing = False
            except (KVStoreError, RuntimeError) as e:
                self._count("heartbeat_failures")
                self._reachable = False
                if not failing:  # log the transition, not every beat
                    log.warning("node %s: heartbeat failed: %s", self.node_id, e)
                failing = True

    def stop(self, unmount: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if unmount:
            try:
                # Best effort: a master that does not hear it drops the node at its node timeout.
                self._master.call("UnmountSegment", pb.KVUnmountSegmentRequest(node_id=self.node_id),
                                  budget_s=UNMOUNT_BUDGET_S)
            except KVStoreError as e:
                log.warning("node %s: unmount failed: %s", self.node_id, e)
        self.server.stop()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        for sid in list(self.regions):
            self.server.unregister(sid)
            self.regions.pop(sid).close()  # the owner unlinks its shared segments
        self._master.close()


_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'1048576', '64M', '1G', '512KiB' -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))


def add_node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", default="127.0.0.1:50070",
                   help="master gRPC address, or primary,standby addresses (comma-separated)")
    p.add_argument("--size", type=parse_size, default=parse_size("1G"), help="bytes per segment (e.g. 1G)")
    p.add_argument("--num-segments", type=int, default=1)
    p.add_argument("--node-id", default=None, help="default: HOSTNAME-PID")
    p.add_argument("--host", default="127.0.0.1", help="data-plane bind address; default loopback only")
    p.add_argument("--port", type=int, default=0, help="data-plane port (0: any free port)")
    p.add_argument("--advertise-host", default=None, help="address clients use (default: the bind address)")
    p.add_argument("--no-shm", action="store_true", help="private memory: no same-host shared-memory path")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--secret-file", default=None, help="data-plane secret file; else $PDCLUSTER_KVSTORE_SECRET")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port (0: any)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="/metrics bind address; default loopback only")
    add_tls_client_args(p)


def build_node(args: argparse.Namespace) -> StorageNode:
    return StorageNode(args.master, load_secret(args.secret_file, create=False), [args.size] * args.num_segments,
                       node_id=args.node_id, host=args.host, port=args.port, advertise_host=args.advertise_host,
                       shared=not args.no_shm, heartbeat_s=args.heartbeat_s, tls_ca=args.tls_ca,
                       tls_cert=args.tls_cert, tls_key=args.tls_key, metrics_host=args.metrics_host,
                       metrics_port=args.metrics_port)


def run_node(args: argparse.Namespace) -> int:
    node = build_node(args)
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    try:
        node.start()
        host, port = node.server.address
        print(json.dumps({"event": "kvstore_node_ready", "node_id": node.node_id, "data_address": f"{host}:{port}",
                          "metrics_port": node.metrics_port,
                          "shm_names": [r.shm_name for r in node.regions.values() if r.shm_name]}), flush=True)
        stop.wait()
    finally:
        node.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdcluster kvstore node", description=__doc__.splitlines()[0])
    add_node_args(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_node(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
