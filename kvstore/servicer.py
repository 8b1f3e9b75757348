"""gRPC servicer of the master: validates requests, calls MetadataStore under the lock, mints tokens.

Tokens are bound to exactly one object's bytes on one segment: READ tokens expire with the get's
lease, WRITE tokens with the put's deadline. The store guarantees those bytes are not reused
before expiry + grace, so a token can never reach another object's data.
"""

from __future__ import annotations

from typing import Any

import grpc

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster._proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.transfer import OP_READ, OP_WRITE

from .core import MasterCore
from .entities import Obj, Status


class MasterServicer(pb_grpc.KVStoreMasterServicer):
    def __init__(self, core: MasterCore) -> None:
        self.core = core
        self.store = core.store
        self.cfg = core.config

    def _check_batch(self, n: int, ctx: grpc.ServicerContext) -> None:
        if n > self.cfg.max_batch:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"batch of {n} exceeds {self.cfg.max_batch}")

    def _replicas(self, obj: Obj, op: int, expiry_ms: int) -> list[pb.KVReplica]:
        out = []
        for p in obj.placements:
            node = self.store.nodes[p.seg.node_id]
            out.append(pb.KVReplica(
                node_id=node.node_id, segment_id=p.seg.segment_id, data_host=node.data_host,
                data_port=node.data_port, host_id=node.host_id, shm_name=p.seg.shm_name,
                segment_size=p.seg.size, offset=p.offset, size=obj.size,
                token=self.core.token(p, op, obj.size, expiry_ms)))
        return out

    # -- objects -----------------------------------------------------------------------------
    def PutStart(self, req: pb.KVPutStartRequest, ctx: grpc.ServicerContext) -> pb.KVPutStartResponse:
        self._check_batch(len(req.items), ctx)
        results = []
        with self.core.lock:
            now = self.core.clock()
            for item in req.items:
                status, obj = self.store.put_start(item.key, item.size, req.replica_num or 1, req.pinned, now)
                res = pb.KVPutStartResult(key=item.key, status=int(status))
                if obj is not None:
                    res.put_id = obj.put_id
                    res.token_expiry_ms = obj.write_expiry_ms
                    res.replicas.extend(self._replicas(obj, OP_WRITE, obj.write_expiry_ms))
                results.append(res)
        return pb.KVPutStartResponse(results=results)

    def PutEnd(self, req: pb.KVPutEndRequest, ctx: grpc.ServicerContext) -> pb.KVPutEndResponse:
        self._check_batch(len(req.puts), ctx)
        with self.core.lock:
            now = self.core.clock()
            return pb.KVPutEndResponse(statuses=[int(self.store.put_end(p.key, p.put_id, now)) for p in req.puts])

    def PutRevoke(self, req: pb.KVPutRevokeRequest, ctx: grpc.ServicerContext) -> pb.KVPutRevokeResponse:
        self._check_batch(len(req.puts), ctx)
        with self.core.lock:
            now = self.core.clock()
            return pb.KVPutRevokeResponse(statuses=[int(self.store.put_revoke(p.key, p.put_id, now))
                                                    for p in req.puts])

    def GetReplicas(self, req: pb.KVGetReplicasRequest, ctx: grpc.ServicerContext) -> pb.KVGetReplicasResponse:
        self._check_batch(len(req.keys), ctx)
        results = []
        with self.core.lock:
            now = self.core.clock()
            for key in req.keys:
                obj = self.store.get(key, now)
                if obj is None:
                    results.append(pb.KVGetReplicasResult(key=key, status=int(Status.NOT_FOUND)))
                    continue
                # The token dies with the lease the store just granted.
                results.append(pb.KVGetReplicasResult(
                    key=key, status=int(Status.OK), size=obj.size, lease_expiry_ms=obj.lease_until_ms,
                    replicas=self._replicas(obj, OP_READ, obj.lease_until_ms)))
        return pb.KVGetReplicasResponse(results=results)

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
        segs = [(s.segment_id, s.size, s.shm_name, s.incarnation) for s in req.segments]
        with self.core.lock:
            self.store.mount(req.node_id, req.data_host, req.data_port, req.host_id, segs, self.core.clock())
        return pb.KVMountSegmentResponse(status=int(Status.OK))

    def UnmountSegment(self, req: pb.KVUnmountSegmentRequest,
                       ctx: grpc.ServicerContext) -> pb.KVUnmountSegmentResponse:
        with self.core.lock:
            st = self.store.unmount(req.node_id, list(req.segment_ids) or None, self.core.clock())
        return pb.KVUnmountSegmentResponse(status=int(st))

    def Heartbeat(self, req: pb.KVHeartbeatRequest, ctx: grpc.ServicerContext) -> pb.KVHeartbeatResponse:
        segs = [(s.segment_id, s.incarnation) for s in req.segments]
        with self.core.lock:
            st = self.store.heartbeat(req.node_id, segs, self.core.clock())
        return pb.KVHeartbeatResponse(status=int(st))

    def Stats(self, req: pb.KVStatsRequest, ctx: grpc.ServicerContext) -> pb.KVStatsResponse:
        s = self.stats()
        fields = {f.name for f in pb.KVStatsResponse.DESCRIPTOR.fields} - {"counters"}
        known: dict[str, Any] = {k: (float(v) if k == "hit_rate" else int(v)) for k, v in s.items() if k in fields}
        return pb.KVStatsResponse(**known, counters={k: float(v) for k, v in s.items() if k not in fields})

    def stats(self) -> dict[str, float]:
        with self.core.lock:
            return self.store.stats()
