"""A primary/standby kvstore master pair as real processes, and the probes the HA tests poll
(tests/kvstore/test_standby*.py); every wait polls with a generous bound."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import grpc

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster._proto import kvstore_pb2_grpc as pb_grpc

BOUND_S = 60.0


def _wait(cond: Callable[[], bool], what: str, bound_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _stub(addr: str) -> tuple[grpc.Channel, pb_grpc.KVStoreMasterStub]:
    ch = grpc.insecure_channel(addr)
    return ch, pb_grpc.KVStoreMasterStub(ch)


def _role(addr: str) -> pb.KVRoleResponse:
    ch, stub = _stub(addr)
    try:
        return stub.GetRole(pb.KVRoleRequest(), timeout=5)
    finally:
        ch.close()


def _objects(addr: str) -> int:
    ch, stub = _stub(addr)
    try:
        return stub.Stats(pb.KVStatsRequest(), timeout=5).objects
    finally:
        ch.close()


class Pair:
    def __init__(self, procs) -> None:  # noqa: ANN001
        self.procs = procs
        self.ports = (procs.free_port(), procs.free_port())
        self.addrs = tuple(f"127.0.0.1:{p}" for p in self.ports)
        self.both = ",".join(self.addrs)

    def start(self, i: int, *, standby: bool, node_timeout_s: float = 5, extra: tuple[str, ...] = ()) -> tuple[object, dict]:
        other = self.addrs[1 - i]
        ha = ["--standby-of", other] if standby else ["--peer", other]
        ha += list(extra)
        return self.procs.spawn("pdcluster.kvstore.master", "--port", str(self.ports[i]),
                                "--node-timeout-s", str(node_timeout_s),
                                "--grace-s", "0.5", "--data-dir", os.path.join(self.procs.tmp, f"master{i}"),
                                "--failover-timeout-s", "1", *ha)
