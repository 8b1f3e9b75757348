"""The standby side of kvstore master high availability (the primary side is failover.py).

A standby follows its primary over FollowOpLog (the master's own gRPC service, so the same TLS /
mTLS and role policy guard it): first a snapshot of the whole state, then every op-log record
in order, applied with the same primitives as a restart's replay (persistence.apply_record) and
acknowledged (AckOpLog) so the primary can hold its replies until the standby has them. With a
--data-dir the standby writes both to its own snapshot + op log: its disk is a replica as well.

Takeover: the stream broken (or silent: the primary sends heartbeats) for `failover_timeout_s`,
the primary still unreachable, and evidence that it is gone (kvstore/takeover.py: by default a
refused connection; silence alone could be a partition) -> the standby takes epoch + 1 (durable before any write), then
exactly what a restarted master does after replay (persistence.finish_recovery): unfinished puts
are dropped (their bytes quarantined until their write tokens expire, so a late writer cannot
touch reused space and its PutEnd gets NOT_FOUND), every object keeps a full lease (read tokens
the old primary issued stay safe), every node gets a full node timeout. It never takes over
before it has loaded one snapshot: an empty standby must not become an empty primary.

Fencing: a primary keeps probing its peer (GetRole); when the peer is primary in a higher
(epoch, address) it steps down and follows it. A restarted old primary started with `--peer`
asks first and comes back as a standby. Clients and nodes refuse answers from an epoch below
the highest they saw (master_rpc.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster._proto import kvstore_pb2_grpc as pb_grpc

from .core import MasterCore
from .failover import NOT_PRIMARY, HAMasterServicer, PrimaryGate, ReplicationHub, Role
from .metadata import MetadataStore
from .oplog import decode
from .persistence import apply_record, finish_recovery, load_snapshot
from .rpc import make_channel
from .takeover import TAKEOVER_MODES, takeover_reason

log = logging.getLogger(__name__)


@dataclass
class HAOptions:
    """standby_of: start as the standby of this primary. peer: the other master; start as primary
    unless it already is one (then follow it). Either way the two watch each other."""

    standby_of: str | None = None
    peer: str | None = None
    failover_timeout_s: float = 3.0
    ack_timeout_s: float = 5.0
    channel: Callable[[str], grpc.Channel] | None = None
    takeover: str = "on-refusal"  # kvstore/takeover.py

    def __post_init__(self) -> None:
        if self.takeover not in TAKEOVER_MODES:
            raise ValueError(f"takeover must be one of {', '.join(TAKEOVER_MODES)}, not {self.takeover!r}")


def build_ha(core: MasterCore, opts: HAOptions, data_dir: str | None) -> HAController:
    """The controller with its role, feed, servicer and gate; `decide()` it once the address is known."""
    role = Role(data_dir)
    hub = ReplicationHub(core, role, ack_timeout_s=opts.ack_timeout_s)
    ctl = HAController(core, role, hub, opts.standby_of or opts.peer or "",
                       channel=opts.channel or (lambda addr: make_channel(addr)),
                       follower_id="", failover_timeout_s=opts.failover_timeout_s)
    ctl.standby_of = opts.standby_of
    ctl.takeover = opts.takeover
    ctl.servicer = HAMasterServicer(core, role, hub, heartbeat_s=max(0.05, opts.failover_timeout_s / 4),
                                    on_higher_epoch=ctl.higher_epoch_seen)
    ctl.gate = PrimaryGate(role, hub)
    return ctl


class HAController:
    """Runs the master's role: follow while standby, watch the peer while primary."""

    def __init__(self, core: MasterCore, role: Role, hub: ReplicationHub, peer: str, *,
                 channel: Callable[[str], grpc.Channel], follower_id: str, failover_timeout_s: float = 3.0,
                 rpc_timeout_s: float = 2.0) -> None:
        self.core, self.role, self.hub = core, role, hub
        self.peer = peer
        self._channel = channel
        self._stubs: dict[str, pb_grpc.KVStoreMasterStub] = {}
        self.follower_id = follower_id
        self.failover_timeout_s = failover_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.synced = False  # loaded a primary's snapshot in this process: may take over
        self.applied = 0
        self.promotions = 0
        self.takeover = "on-refusal"
        self._operator_promote = threading.Event()
        self._refused_logged = 0.0
        hub.counters.setdefault("takeovers_refused", 0)
        self._last_contact = time.monotonic()
        self._call: grpc.Future | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._ack_cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._pieces: list[bytes] = []  # of a snapshot arriving in pieces
        self.standby_of: str | None = None
        self.servicer: HAMasterServicer | None = None  # set by build_ha
        self.gate: PrimaryGate | None = None

    def decide(self, address: str) -> str:
        """Before serving: standby (of --standby-of, or of a peer that is primary already), else
        recover from the data directory and be primary. Returns the role's name."""
        self.role.address = self.follower_id = address
        r = None if self.standby_of else (self.probe(self.peer) if self.peer else None)
        if self.standby_of or (r is not None and r.primary):
            self.role.become_standby(self.standby_of or self.peer, r.epoch if r is not None else 0)
            return "standby"
        self.core.recover()
        with self.core.lock:
            self.hub.install()
            self.role.become_primary(r.epoch if r is not None else 0)
        return "primary"

    def stub(self, addr: str) -> pb_grpc.KVStoreMasterStub:
        if addr not in self._stubs:
            self._stubs[addr] = pb_grpc.KVStoreMasterStub(self._channel(addr))
        return self._stubs[addr]

    def probe(self, addr: str) -> pb.KVRoleResponse | None:
        try:
            return self.stub(addr).GetRole(pb.KVRoleRequest(), timeout=self.rpc_timeout_s)
        except grpc.RpcError:
            return None

    def start(self) -> HAController:
        for target, name in ((self._run, "kvstore-ha"), (self._ack_loop, "kvstore-ha-ack"),
                             (self._watchdog, "kvstore-ha-watchdog")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        call = self._call
        if call is not None:
            call.cancel()
        with self._ack_cond:
            self._ack_cond.notify_all()
        for t in self._threads:
            t.join(5)

    def higher_epoch_seen(self, epoch: int) -> None:
        self._wake.set()  # check the peer now

    def request_promotion(self) -> None:
        """The operator's word that the primary is dead (SIGUSR1): the next check promotes, if synced."""
        self._operator_promote.set()

    # -- the role loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.role.primary:
                    self._watch_peer()
                else:
                    self._follow_once()
            except Exception:  # the loop must survive anything; the error is logged
                log.exception("kvstore master HA loop failed")
                self._stop.wait(0.5)

    def _watch_peer(self) -> None:
        self._wake.wait(self.failover_timeout_s)
        self._wake.clear()
        r = self.probe(self.peer) if self.peer else None
        if r is not None and r.primary and (r.epoch, self.peer) > (self.role.epoch, self.role.address):
            log.warning("kvstore master: %s is primary in epoch %d (ours %d): stepping down", self.peer, r.epoch,
                        self.role.epoch)
            self.step_down(self.peer, r.epoch)

    def step_down(self, primary: str, epoch: int) -> None:
        with self.core.lock:
            self.role.become_standby(primary, epoch)
            self.core.store._log = None  # the primary's snapshot replaces this state
            if self.core.oplog is not None:
                self.core.oplog.close()
        self.synced = False

    def _follow_once(self) -> None:
        target = self.role.primary_address or self.peer
        self._pieces = []
        try:
            call = self.stub(target).FollowOpLog(pb.KVFollowRequest(follower_id=self.follower_id,
                                                                     epoch=self.role.epoch))
            self._call = call
            for entry in call:
                self._last_contact = time.monotonic()
                if entry.epoch < self.role.epoch:
                    log.warning("kvstore standby: %s sends epoch %d < %d: ignored", target, entry.epoch,
                                self.role.epoch)
                    call.cancel()
                    break
                if not self._apply(entry):
                    call.cancel()
                    break
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and NOT_PRIMARY in (e.details() or ""):
                r = self.probe(target)  # it is a standby itself: follow whom it follows
                if r is not None and r.primary_address and r.primary_address != self.role.address:
                    self.role.primary_address = r.primary_address
        finally:
            self._call = None
        if self._stop.is_set():
            return
        lost_s = time.monotonic() - self._last_contact
        if self.synced and lost_s >= self.failover_timeout_s and not self._primary_alive(target):
            why = takeover_reason(self.takeover, target, lost_s, self.rpc_timeout_s, self._operator_promote.is_set())
            if why is not None:
                log.warning("kvstore standby: primary %s lost: %s: taking over", target, why)
                self.promote()
                return
            self._refuse_takeover(target, lost_s)
        if not self.synced and lost_s >= self.failover_timeout_s:
            log.warning("kvstore standby: no primary at %s and never synced: not taking over", target)
            self._last_contact = time.monotonic()
        self._stop.wait(min(0.2, self.failover_timeout_s / 4))

    def _refuse_takeover(self, target: str, lost_s: float) -> None:
        self.hub.counters["takeovers_refused"] += 1
        now = time.monotonic()
        if now - self._refused_logged >= 30.0:  # once per half minute, not once per probe
            self._refused_logged = now
            log.warning("kvstore standby: primary %s silent for %.1fs but not shown dead (alive and partitioned "
                        "from us?): not taking over; still refusing writes (kill -USR1 %d to promote)",
                        target, lost_s, os.getpid())

    def _primary_alive(self, target: str) -> bool:
        r = self.probe(target)
        return r is not None and r.primary and r.epoch >= self.role.epoch

    def _apply(self, entry: pb.KVOpLogEntry) -> bool:
        now = self.core.clock()
        if entry.kind == pb.KVOpLogEntry.HEARTBEAT:
            return True
        if entry.kind == pb.KVOpLogEntry.SNAPSHOT:
            self._pieces.append(entry.payload)
            if entry.more:
                return True
            state = decode(b"".join(self._pieces))
            self._pieces = []
            store = MetadataStore(self.core.config)
            load_snapshot(store, state, now)
            with self.core.lock:
                self.core.store = store
            self._persist_snapshot(state)
            self.role.note_epoch(entry.epoch)
            self.synced = True
            self._refused_logged = 0.0  # a later loss logs again at once
            log.info("kvstore standby: synced with epoch %d at seq %d (%d objects)", entry.epoch, entry.seq,
                     len(store.objects))
        else:
            if entry.seq != self.applied + 1:
                log.warning("kvstore standby: gap in the op log (%d after %d): following again", entry.seq,
                            self.applied)
                return False
            rec = decode(entry.payload)
            with self.core.lock:
                apply_record(self.core.store, rec, now)
                if self.core.oplog is not None:
                    self.core.oplog.append(rec)  # the standby's own disk is a replica too
        with self._ack_cond:
            self.applied = entry.seq
            self._ack_cond.notify_all()
        return True

    def _persist_snapshot(self, state: dict) -> None:
        # The primary's state replaces whatever this data directory held (a restart of this
        # master then recovers the replica, not an older history of its own).
        oplog = self.core.oplog
        if oplog is None:
            return
        if not oplog.is_open:
            oplog.open_fresh()
        oplog.write_snapshot(state, oplog.rotate())

    def promote(self) -> None:
        core = self.core
        with core.lock:
            finish_recovery(core.store, core.clock())
            core.store._log = None
            if core.oplog is not None:
                if not core.oplog.is_open:
                    core.oplog.open_fresh()
                core.store._log = core.oplog.append
            self.hub.install()
            epoch = self.role.become_primary()
        core.snapshot()
        self.promotions += 1
        self._operator_promote.clear()
        self._refused_logged = 0.0
        self.peer = self.peer or self.role.primary_address
        log.warning("kvstore master %s: took over as primary in epoch %d (%d objects)", self.role.address, epoch,
                    len(core.store.objects))

    # -- helpers -----------------------------------------------------------------------------------
    def _ack_loop(self) -> None:
        sent = 0
        while not self._stop.is_set():
            with self._ack_cond:
                self._ack_cond.wait_for(lambda sent=sent: self.applied != sent or self._stop.is_set(), timeout=0.5)
                seq = self.applied
            if seq == sent or self.role.primary:
                continue
            try:
                self.stub(self.role.primary_address or self.peer).AckOpLog(
                    pb.KVAckRequest(follower_id=self.follower_id, seq=seq, epoch=self.role.epoch),
                    timeout=self.rpc_timeout_s)
                sent = seq
            except grpc.RpcError:
                self._stop.wait(0.05)

    def _watchdog(self) -> None:
        # A hung primary keeps its stream open but stops its heartbeats: cancel it, so the role
        # loop sees the loss.
        while not self._stop.wait(min(0.2, self.failover_timeout_s / 4)):
            call = self._call
            if call is not None and time.monotonic() - self._last_contact >= self.failover_timeout_s:
                call.cancel()
