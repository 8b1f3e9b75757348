"""gRPC servicer of the master: validates requests, calls MetadataStore under the lock, mints tokens.

Tokens are bound to exactly one object's bytes (or one write arena's extent) on one segment: READ
tokens expire with the get's lease, WRITE tokens with the put's or arena's deadline. The store
guarantees those bytes are not reused before expiry + grace, so a token can never reach another
object's data.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster._proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.transfer import OP_READ, OP_WRITE

from .authz import node_id_refusal
from .core import MasterCore
from .entities import Node, Placement, Segment, Status
from .object_mac import MAX_MAC_LEN

log = logging.getLogger(__name__)


class MasterServicer(pb_grpc.KVStoreMasterServicer):
    def __init__(self, core: MasterCore) -> None:
        self.core = core
        self.store = core.store
        self.cfg = core.config
        self._templates: dict[int, tuple[Segment, tuple[str, int, str], pb.KVReplica]] = {}
        self.refusals: dict[str, int] = {}  # node-identity refusals by reason (kvstore/authz.py)
        self.lookup: Any = None  # the same-host LookupSocket, set by MasterServer (kvstore/lookup_socket.py)

    def _refuse_node(self, ctx: grpc.ServicerContext, reason: str, why: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        log.warning("kvstore master refused %s from %s: %s", reason, ctx.peer(), why)
        ctx.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    def _check_node(self, ctx: grpc.ServicerContext, node_id: str) -> None:
        why = node_id_refusal(ctx, node_id)
        if why is not None:
            self._refuse_node(ctx, "wrong_node_id", why)

    def _check_batch(self, n: int, ctx: grpc.ServicerContext) -> None:
        if n > self.cfg.max_batch:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"batch of {n} exceeds {self.cfg.max_batch}")

    def _add_replicas(self, out: Any, placements: list[Placement], size: int, op: int, expiry_ms: int,
                      shm_host_id: str = "") -> None:
        """Append a KVReplica per placement to the repeated field `out`. shm_host_id: the caller
        copies replicas on that host through shared memory, which needs no token, so none is
        minted for them. Replicas are copied from a per-segment template and then patched:
        building an 11-field message from keyword arguments costs several times more, and that
        was most of the master's per-key time."""
        for p in placements:
            node: Node = self.store.nodes[p.seg.node_id]
            r = out.add()
            r.CopyFrom(self._template(node, p.seg))
            r.offset = p.offset
            r.size = size
            if not (shm_host_id and node.host_id == shm_host_id and p.seg.shm_name):
                r.token = self.core.token(p, op, size, expiry_ms)

    def _template(self, node: Node, seg: Segment) -> pb.KVReplica:
        # Called under core.lock (like everything that reads the store), which also guards the cache.
        where = (node.data_host, node.data_port, node.host_id)
        hit = self._templates.get(id(seg))
        if hit is None or hit[0] is not seg or hit[1] != where:  # new segment, or its node moved
            if len(self._templates) > 4 * len(self.store.segments()) + 64:
                self._templates.clear()  # drop templates of unmounted segments now and then
            t = pb.KVReplica(node_id=node.node_id, segment_id=seg.segment_id, data_host=node.data_host,
                             data_port=node.data_port, host_id=node.host_id, shm_name=seg.shm_name,
                             segment_size=seg.size)
            hit = self._templates[id(seg)] = (seg, where, t)
        return hit[2]

    # -- objects -----------------------------------------------------------------------------
    def PutStart(self, req: pb.KVPutStartRequest, ctx: grpc.ServicerContext) -> pb.KVPutStartResponse:
        self._check_batch(len(req.items), ctx)
        resp = pb.KVPutStartResponse()
        with self.core.lock:
            now = self.core.clock()
            for item in req.items:
                status, obj = self.store.put_start(item.key, item.size, req.replica_num or 1, req.pinned, now)
                res = resp.results.add()
                res.key = item.key
                res.status = int(status)
                if obj is not None:
                    res.put_id = obj.put_id
                    res.token_expiry_ms = obj.write_expiry_ms
                    self._add_replicas(res.replicas, obj.placements, obj.size, OP_WRITE, obj.write_expiry_ms)
        return resp

    def PutEnd(self, req: pb.KVPutEndRequest, ctx: grpc.ServicerContext) -> pb.KVPutEndResponse:
        self._check_batch(len(req.puts), ctx)
        with self.core.lock:
            now = self.core.clock()
            return pb.KVPutEndResponse(statuses=[
                int(self.store.put_end(p.key, p.put_id, now, p.mac)) if len(p.mac) <= MAX_MAC_LEN
                else int(Status.INVALID) for p in req.puts])

    def PutRevoke(self, req: pb.KVPutRevokeRequest, ctx: grpc.ServicerContext) -> pb.KVPutRevokeResponse:
        self._check_batch(len(req.puts), ctx)
        with self.core.lock:
            now = self.core.clock()
            return pb.KVPutRevokeResponse(statuses=[int(self.store.put_revoke(p.key, p.put_id, now))
                                                    for p in req.puts])

    def ReserveArena(self, req: pb.KVReserveArenaRequest, ctx: grpc.ServicerContext) -> pb.KVReserveArenaResponse:
        with self.core.lock:
            status, arena = self.store.arena_reserve(req.size, req.replica_num or 1, self.core.clock())
            if arena is None:
                return pb.KVReserveArenaResponse(status=int(status))
            resp = pb.KVReserveArenaResponse(status=int(Status.OK), arena_id=arena.arena_id, size=arena.size,
                                             align=self.cfg.align, token_expiry_ms=arena.write_expiry_ms)
            self._add_replicas(resp.replicas, arena.placements, arena.size, OP_WRITE, arena.write_expiry_ms)
            return resp

    def CommitArena(self, req: pb.KVCommitArenaRequest, ctx: grpc.ServicerContext) -> pb.KVCommitArenaResponse:
        self._check_batch(len(req.items), ctx)
        return self.commit_arena(req)

    def commit_arena(self, req: pb.KVCommitArenaRequest) -> pb.KVCommitArenaResponse:
        """CommitArena's answer (the batch already checked): over gRPC and the lookup socket."""
        items = [(item.key, item.offset, item.size if len(item.mac) <= MAX_MAC_LEN else 0, item.mac)
                 for item in req.items]  # size 0: INVALID
        with self.core.lock:
            status, statuses = self.store.arena_commit(req.arena_id, items, req.pinned, self.core.clock())
        return pb.KVCommitArenaResponse(status=int(status), statuses=[int(s) for s in statuses])

    def ReleaseArena(self, req: pb.KVReleaseArenaRequest, ctx: grpc.ServicerContext) -> pb.KVReleaseArenaResponse:
        with self.core.lock:
            return pb.KVReleaseArenaResponse(status=int(self.store.arena_release(req.arena_id, self.core.clock())))

    def GetReplicas(self, req: pb.KVGetReplicasRequest, ctx: grpc.ServicerContext) -> pb.KVGetReplicasResponse:
        self._check_batch(len(req.keys), ctx)
        return self.get_replicas(req)

    def OpenLookup(self, req: pb.KVOpenLookupRequest, ctx: grpc.ServicerContext) -> pb.KVOpenLookupResponse:
        """A ticket for the same-host lookup socket (kvstore/lookup_socket.py); empty without one."""
        issued = self.lookup.issue() if self.lookup is not None else None
        if issued is None:
            return pb.KVOpenLookupResponse()
        return pb.KVOpenLookupResponse(path=self.lookup.path, ticket=issued[0], expiry_ms=issued[1],
                                       host_id=self.lookup.host_id)

    def get_replicas(self, req: pb.KVGetReplicasRequest) -> pb.KVGetReplicasResponse:
        """GetReplicas' answer (the batch already checked): over gRPC and the lookup socket."""
        resp = pb.KVGetReplicasResponse()
        with self.core.lock:
            now = self.core.clock()
            for key in req.keys:
                res = resp.results.add()
                res.key = key
                obj = self.store.get(key, now)
                if obj is None:
                    res.status = int(Status.NOT_FOUND)
                    continue
                res.size = obj.size
                res.lease_expiry_ms = obj.lease_until_ms
                if obj.mac:
                    res.mac = obj.mac
                # The token dies with the lease the store just granted.
                self._add_replicas(res.replicas, obj.placements, obj.size, OP_READ, obj.lease_until_ms,
                                   req.shm_host_id)
        return resp

    def Exists(self, req: pb.KVExistsRequest, ctx: grpc.ServicerContext) -> pb.KVExistsResponse:
        with self.core.lock:
            return pb.KVExistsResponse(exists=self.store.exists(req.key))

    def BatchExists(self, req: pb.KVBatchExistsRequest, ctx: grpc.ServicerContext) -> pb.KVBatchExistsResponse:
        self._check_batch(len(req.keys), ctx)
        with self.core.lock:
            return pb.KVBatchExistsResponse(exists=[self.store.exists(k) for k in req.keys])

    def Remove(self, req: pb.KVRemoveRequest, ctx: grpc.ServicerContext) -> pb.KVRemoveResponse:
        self._check_batch(len(req.keys), ctx)
        with self.core.lock:
            now = self.core.clock()
            return pb.KVRemoveResponse(statuses=[int(self.store.remove(k, now)) for k in req.keys])

    # -- nodes -------------------------------------------------------------------------------
    def MountSegment(self, req: pb.KVMountSegmentRequest, ctx: grpc.ServicerContext) -> pb.KVMountSegmentResponse:
        bad = (not req.node_id or len(req.node_id) > 256 or not req.segments or not 0 < req.data_port < 65536
               or len(req.segments) > 1024 or any(s.size == 0 or s.segment_id == 0 for s in req.segments))
        if bad:
            return pb.KVMountSegmentResponse(status=int(Status.INVALID))
        self._check_node(ctx, req.node_id)
        segs = [(s.segment_id, s.size, s.shm_name, s.incarnation) for s in req.segments]
        with self.core.lock:
            live = self.store.nodes.get(req.node_id)
            moved = live is not None and (live.data_host, live.data_port, live.host_id) != (
                req.data_host, req.data_port, req.host_id)
            if moved and self.core.clock() - live.last_seen_ms < self.cfg.node_timeout_s * 1000:
                self._refuse_node(ctx, "live_node_moved", f"node {req.node_id!r} is live at "
                                  f"{live.data_host}:{live.data_port}: its address cannot change")
            self.store.mount(req.node_id, req.data_host, req.data_port, req.host_id, segs, self.core.clock())
        return pb.KVMountSegmentResponse(status=int(Status.OK))

    def UnmountSegment(self, req: pb.KVUnmountSegmentRequest,
                       ctx: grpc.ServicerContext) -> pb.KVUnmountSegmentResponse:
        self._check_node(ctx, req.node_id)
        with self.core.lock:
            status = self.store.unmount(req.node_id, list(req.segment_ids) or None, self.core.clock())
        return pb.KVUnmountSegmentResponse(status=int(status))

    def Heartbeat(self, req: pb.KVHeartbeatRequest, ctx: grpc.ServicerContext) -> pb.KVHeartbeatResponse:
        self._check_node(ctx, req.node_id)
        segs = [(s.segment_id, s.incarnation) for s in req.segments]
        with self.core.lock:
            status = self.store.heartbeat(req.node_id, segs, self.core.clock())
            usage = self.store.table.usage(req.node_id) if status == Status.OK else None
        resp = pb.KVHeartbeatResponse(status=int(status))
        if usage is not None:  # the node's /metrics: only the master knows what it placed there
            resp.used_bytes, resp.objects, resp.object_bytes = usage
        return resp

    def Stats(self, req: pb.KVStatsRequest, ctx: grpc.ServicerContext) -> pb.KVStatsResponse:
        s = self.stats()
        fields = {f.name for f in pb.KVStatsResponse.DESCRIPTOR.fields} - {"counters"}
        known: dict[str, Any] = {k: (float(v) if k == "hit_rate" else int(v)) for k, v in s.items() if k in fields}
        return pb.KVStatsResponse(**known, counters={k: float(v) for k, v in s.items() if k not in fields})

    def stats(self) -> dict[str, float]:
        with self.core.lock:
            out = self.store.stats() | {f"refused_{k}": v for k, v in self.refusals.items()}
        return out | (dict(self.lookup.counters) if self.lookup is not None else {})
