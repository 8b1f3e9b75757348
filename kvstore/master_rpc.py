"""The kvstore client's connection to the master: one gRPC stub, a per-call timeout, one error."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from pdcluster._proto import kvstore_pb2_grpc as pb_grpc

from .rpc import make_channel


class KVStoreError(Exception):
    """The master is unreachable, or an object's bytes could not be read. `results` holds what a
    batch call did get (None for misses and failures), `failed` the keys that failed."""

    def __init__(self, msg: str, results: list[Any] | None = None, failed: list[str] | None = None) -> None:
        super().__init__(msg)
        self.results = results
        self.failed = failed or []
        self.failover = False  # set by MasterRPC: another master address may answer


class MasterRPC:
    """`master_addr`: one address, or several ("a:1,b:2" or a list) of a primary/standby pair
    (kvstore/standby.py). With several, a call that finds its master down or a standby
    (FAILED_PRECONDITION NOT_PRIMARY) moves to the next address and retries until `failover_s`
    passed; an answer from an epoch below the highest seen (a fenced old primary) counts as a
    refusal too. Retries are safe: PutStart of a key already pending answers IN_PROGRESS, PutEnd
    is idempotent, and a put the new primary never saw ends NOT_FOUND (a clear failure)."""

    def __init__(self, master_addr: str | Sequence[str], *, timeout_s: float = 10.0, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, failover_s: float = 30.0) -> None:
        addrs = master_addr.split(",") if isinstance(master_addr, str) else list(master_addr)
        self._addrs = [a.strip() for a in addrs if a.strip()]
        if not self._addrs:
            raise ValueError("no kvstore master address")
        self._tls = {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key}
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[int, pb_grpc.KVStoreMasterStub] = {}
        self._current = 0
        self._epoch = 0  # the highest master epoch answered so far
        self._lock = threading.Lock()
        self._timeout = timeout_s
        self._failover_s = failover_s if len(self._addrs) > 1 else 0.0
        self._stub_at(0)  # connect eagerly, as before

    @property
    def address(self) -> str:
        return self._addrs[self._current]

    def _stub_at(self, i: int) -> pb_grpc.KVStoreMasterStub:
        with self._lock:
            if i not in self._stubs:
                self._channels[i] = make_channel(self._addrs[i], **self._tls)
                self._stubs[i] = pb_grpc.KVStoreMasterStub(self._channels[i])
            return self._stubs[i]

    def call(self, method: str, request: Message, *, wait_s: float | None = None,
             budget_s: float | None = None) -> Any:
        """The master's answer to `method`; KVStoreError when the call failed. wait_s: wait that
        long for a master to come up (gRPC wait_for_ready). budget_s: give up after that long in
        all, failover included (a best-effort call, e.g. a node's unmount at shutdown)."""
        if self._failover_s == 0.0:
            return self._call_one(0, method, request, wait_s, budget_s)
        span = max(self._failover_s, wait_s or 0.0)
        deadline = time.monotonic() + (span if budget_s is None else min(span, budget_s))
        while True:
            i = self._current
            try:
                left = max(0.05, deadline - time.monotonic())
                return self._call_one(i, method, request, min(left, wait_s) if wait_s else None,
                                      left if budget_s is not None else None)
            except KVStoreError as e:
                if not e.failover:
                    raise
                with self._lock:  # the next call starts at the next address even if this one gives up
                    if self._current == i:
                        self._current = (i + 1) % len(self._addrs)
                if time.monotonic() >= deadline:
                    raise
                if self._current == 0:
                    time.sleep(0.05)  # a full round refused: the standby may still be taking over

    def _call_one(self, i: int, method: str, request: Message, wait_s: float | None,
                  cap_s: float | None = None) -> Any:
        stub = self._stub_at(i)
        timeout = wait_s or self._timeout
        if cap_s is not None:
            timeout = min(timeout, cap_s)
        try:
            resp, call = getattr(stub, method).with_call(request, timeout=timeout,
                                                         wait_for_ready=wait_s is not None or None)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            moved = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or (
                code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("NOT_PRIMARY"))
            err = KVStoreError(f"kvstore master {self._addrs[i]} {method} failed: {code.name}: {details}")
            err.failover = moved
            raise err from e
        epoch = _epoch_of(call)
        if not self.accept_epoch(epoch):
            err = KVStoreError(f"kvstore master {self._addrs[i]} answered from epoch {epoch} < {self._epoch}: "
                               "a fenced old primary")
            err.failover = True
            raise err
        return resp

    def accept_epoch(self, epoch: int) -> bool:
        """Note the epoch of an answer; False: it is below the highest seen (a fenced old primary)."""
        with self._lock:
            if epoch < self._epoch and len(self._addrs) > 1:
                return False
            self._epoch = epoch
            return True

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()


def _epoch_of(call: Any) -> int:
    for key, value in call.trailing_metadata() or ():
        if key == "kv-epoch":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


__all__ = ["KVStoreError", "MasterRPC"]
