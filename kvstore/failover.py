"""The primary side of kvstore master high availability: role + epoch, the op-log feed, the gate.

A master is PRIMARY (serves everything) or STANDBY (follows a primary, kvstore/standby.py, and
answers every object/node RPC with FAILED_PRECONDITION "NOT_PRIMARY ..." so clients and nodes
move on to the next address). Each primary term has an epoch, durable in the data directory
(oplog.write_epoch) before the term's first write, sent on every op-log entry and in the
`kv-epoch` trailing metadata of every answer: clients and nodes refuse answers from a lower epoch
than they saw (master_rpc.py), a follower refuses entries from one, a primary that hears of a
higher one steps down.

Replication is semi-synchronous: a mutating RPC replies only after every attached follower
acknowledged the records it produced (PrimaryGate), so an acknowledged put is on the standby
before the client hears OK. A follower that does not acknowledge within `ack_timeout_s` is
detached (the primary keeps serving alone, counted in `replication_followers_dropped`) and must
follow again from a fresh snapshot.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster.security.grpc_authz import RolePolicy

from .core import MasterCore
from .entities import Status
from .oplog import encode, read_epoch, write_epoch
from .persistence import snapshot_state
from .servicer import MasterServicer

log = logging.getLogger(__name__)

EPOCH_METADATA = "kv-epoch"
NOT_PRIMARY = "NOT_PRIMARY"
# Answered by a standby too: how a peer finds the primary, and the standby's own feed.
OPEN_METHODS = frozenset({"FollowOpLog", "AckOpLog", "GetRole", "Stats"})
FOLLOWER_QUEUE = 200_000  # records buffered per follower before it is dropped (it re-follows)
SNAPSHOT_PIECE = 4 << 20  # a big state goes in pieces, each well under the channels' message limit


def restrict_feed(policy: RolePolicy) -> RolePolicy:
    """Under mutual TLS only another master may follow this one's op log (it holds every object's
    placement); anyone CA-signed may ask its role, as for Stats."""
    for method in ("FollowOpLog", "AckOpLog"):
        policy.allowed["/pdcluster.v1.KVStoreMaster/" + method] = frozenset({"kvstore-master"})
    return policy


class Role:
    """Primary or standby, the current epoch (durable under data_dir), whom a standby follows."""

    def __init__(self, data_dir: str | None, address: str = "") -> None:
        self.data_dir = data_dir
        self.address = address
        self.epoch = read_epoch(data_dir) if data_dir else 0
        self.primary = False
        self.primary_address = ""
        self.lock = threading.Lock()

    def become_primary(self, seen_epoch: int = 0) -> int:
        """Take a new term above every epoch known; durable before the caller accepts a write."""
        with self.lock:
            self.epoch = max(self.epoch, seen_epoch) + 1
            if self.data_dir:
                write_epoch(self.data_dir, self.epoch)
            self.primary, self.primary_address = True, self.address
            return self.epoch

    def become_standby(self, primary_address: str, epoch: int = 0) -> None:
        with self.lock:
            self.primary, self.primary_address = False, primary_address
            self.note_epoch(epoch)

    def note_epoch(self, epoch: int) -> None:
        if epoch > self.epoch:
            self.epoch = epoch
            if self.data_dir:
                write_epoch(self.data_dir, epoch)


class _Follower:
    def __init__(self, follower_id: str) -> None:
        self.follower_id = follower_id
        self.entries: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue(FOLLOWER_QUEUE)
        self.acked = 0
        self.dropped = False


class ReplicationHub:
    """Sequences every op-log record the store emits and hands it to each attached follower."""

    def __init__(self, core: MasterCore, role: Role, ack_timeout_s: float = 5.0) -> None:
        self.core, self.role = core, role
        self.ack_timeout_s = ack_timeout_s
        self.seq = 0
        self.followers: dict[str, _Follower] = {}
        self.counters = {"replication_followers_dropped": 0, "replication_ack_waits": 0}
        self._cond = threading.Condition()
        self._mine = threading.local()  # the last seq the calling RPC thread produced

    def install(self) -> None:
        """Tee the store's op-log writer (the file, if any) into the feed. Call under core.lock."""
        inner = self.core.store._log
        self.core.store._log = lambda rec: self._emit(inner, rec)

    def _emit(self, inner: Callable[[dict[str, Any]], None] | None, rec: dict[str, Any]) -> None:
        if inner is not None:
            inner(rec)  # durable locally first, as without a standby
        with self._cond:
            self.seq += 1
            self._mine.seq = self.seq
            for f in list(self.followers.values()):
                try:
                    f.entries.put_nowait((self.seq, rec))
                except queue.Full:
                    self._drop(f, "fell too far behind")

    def _drop(self, f: _Follower, why: str) -> None:  # under _cond
        if self.followers.get(f.follower_id) is f:
            del self.followers[f.follower_id]
            f.dropped = True
            self.counters["replication_followers_dropped"] += 1
            log.warning("kvstore master: dropped follower %s: %s", f.follower_id, why)
            self._cond.notify_all()
            try:
                f.entries.put_nowait(None)
            except queue.Full:
                pass  # its stream sees `dropped` at the next entry

    def attach(self, follower_id: str) -> tuple[_Follower, bytes, int]:
        """A follower and the snapshot + seq it starts from (consistent: taken under core.lock)."""
        with self.core.lock:
            state = snapshot_state(self.core.store)  # fresh lists of plain values: encoded outside the lock
            with self._cond:
                old = self.followers.get(follower_id)
                if old is not None:
                    self._drop(old, "followed again")
                f = self.followers[follower_id] = _Follower(follower_id)
                f.acked = seq = self.seq
        return f, encode(state), seq

    def detach(self, f: _Follower) -> None:
        with self._cond:
            self._drop(f, "stream ended")

    def ack(self, follower_id: str, seq: int) -> bool:
        with self._cond:
            f = self.followers.get(follower_id)
            if f is None:
                return False
            f.acked = max(f.acked, seq)
            self._cond.notify_all()
            return True

    def begin_call(self) -> None:
        self._mine.seq = 0

    def wait_replicated(self) -> None:
        """Block until every follower acknowledged what this thread's RPC produced (or drop it)."""
        seq = getattr(self._mine, "seq", 0)
        if not seq:
            return
        deadline = time.monotonic() + self.ack_timeout_s
        with self._cond:
            while True:
                behind = [f for f in self.followers.values() if f.acked < seq]
                if not behind:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    for f in behind:
                        self._drop(f, f"no acknowledgement within {self.ack_timeout_s}s")
                    return
                self.counters["replication_ack_waits"] += 1
                self._cond.wait(left)


class PrimaryGate(grpc.ServerInterceptor):
    """Refuse object/node RPCs on a standby; stamp the epoch; hold replies until replicated."""

    def __init__(self, role: Role, hub: ReplicationHub) -> None:
        self.role, self.hub = role, hub

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        method = details.method.rsplit("/", 1)[-1]
        if handler is None or handler.unary_unary is None or method in OPEN_METHODS:
            return handler
        inner = handler.unary_unary

        def behavior(request: Any, ctx: grpc.ServicerContext) -> Any:
            role = self.role
            ctx.set_trailing_metadata(((EPOCH_METADATA, str(role.epoch)),))
            if not role.primary:
                ctx.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{NOT_PRIMARY}: this kvstore master is a standby of {role.primary_address or '?'}")
            self.hub.begin_call()
            resp = inner(request, ctx)
            self.hub.wait_replicated()
            return resp

        return grpc.unary_unary_rpc_method_handler(behavior, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


class HAMasterServicer(MasterServicer):
    """The master's servicer plus the HA methods. `store` follows core.store: a standby replaces
    its whole store when it (re)loads a primary's snapshot."""

    def __init__(self, core: MasterCore, role: Role, hub: ReplicationHub, heartbeat_s: float = 0.5,
                 on_higher_epoch: Callable[[int], None] | None = None) -> None:
        super().__init__(core)
        self.role, self.hub = role, hub
        self.heartbeat_s = heartbeat_s
        self._on_higher_epoch = on_higher_epoch or (lambda epoch: None)

    @property  # type: ignore[override]
    def store(self) -> Any:
        return self.core.store

    @store.setter
    def store(self, value: Any) -> None:
        pass  # MasterServicer.__init__ assigns it; the property always reads core.store

    def FollowOpLog(self, req: pb.KVFollowRequest, ctx: grpc.ServicerContext) -> Iterator[pb.KVOpLogEntry]:
        if req.epoch > self.role.epoch:
            self._on_higher_epoch(req.epoch)  # a follower knows a newer term: we are stale
        if not self.role.primary:
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{NOT_PRIMARY}: standby of {self.role.primary_address}")
        if not req.follower_id or len(req.follower_id) > 256:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "follower_id required")
        f, state, seq = self.hub.attach(req.follower_id)
        log.info("kvstore master: follower %s attached at seq %d (%s)", req.follower_id, seq, ctx.peer())
        epoch = self.role.epoch
        try:
            for at in range(0, max(len(state), 1), SNAPSHOT_PIECE):
                yield pb.KVOpLogEntry(epoch=epoch, seq=seq, kind=pb.KVOpLogEntry.SNAPSHOT,
                                      payload=state[at:at + SNAPSHOT_PIECE], more=at + SNAPSHOT_PIECE < len(state))
            del state
            while ctx.is_active() and self.role.primary and not f.dropped:
                try:
                    item = f.entries.get(timeout=self.heartbeat_s)
                except queue.Empty:
                    yield pb.KVOpLogEntry(epoch=epoch, kind=pb.KVOpLogEntry.HEARTBEAT)
                    continue
                if item is None:
                    break
                yield pb.KVOpLogEntry(epoch=epoch, seq=item[0], kind=pb.KVOpLogEntry.RECORD, payload=encode(item[1]))
        finally:
            self.hub.detach(f)

    def AckOpLog(self, req: pb.KVAckRequest, ctx: grpc.ServicerContext) -> pb.KVAckResponse:
        ok = self.role.primary and req.epoch == self.role.epoch and self.hub.ack(req.follower_id, req.seq)
        return pb.KVAckResponse(status=int(Status.OK if ok else Status.NOT_FOUND))

    def GetRole(self, req: pb.KVRoleRequest, ctx: grpc.ServicerContext) -> pb.KVRoleResponse:
        role = self.role
        return pb.KVRoleResponse(primary=role.primary, epoch=role.epoch, primary_address=role.primary_address)

    def stats(self) -> dict[str, float]:
        return super().stats() | self.hub.counters | {"epoch": self.role.epoch, "primary": int(self.role.primary),
                                                      "followers": len(self.hub.followers)}
