"""KVStoreClient: put/get objects into and out of caller-provided buffers (zero-copy).

    client = KVStoreClient("127.0.0.1:50070")
    client.put("k", tensor)                 # Status.OK / ALREADY_EXISTS / IN_PROGRESS / NO_SPACE / ...
    n = client.get("k", out_tensor)         # bytes read, or None on a miss

Puts are two-phase: PutStart (master allocates, returns WRITE tokens) -> the bytes go straight
from the caller's buffer to every replica -> PutEnd publishes. If any replica write fails the
put is revoked, so a partial object is never visible. Gets take a lease (the master keeps the
bytes until it expires) and read one replica, trying the next on failure.

Path per replica: same host (host id match) and shared segment -> map it and memcpy; otherwise
the TCP data plane with several streams. A shared-memory attempt that fails falls back to TCP.
The shm path skips the node's token check (the OS file mode is the guard), so the client checks
the token/lease expiry itself before copying; the master's grace period covers the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster._proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.transfer import (
    SharedRegionCache,
    TransferClient,
    TransferError,
    as_byte_view,
    local_host_id,
    now_ms,
)

from .entities import Status
from .rpc import make_channel


class KVStoreError(Exception):
    """The master is unreachable, or an object's bytes could not be read. `results` holds what a
    batch call did get (None for misses and failures), `failed` the keys that failed."""

    def __init__(self, msg: str, results: list[Any] | None = None, failed: list[str] | None = None) -> None:
        super().__init__(msg)
        self.results = results
        self.failed = failed or []


@dataclass
class PendingPut:
    key: str
    put_id: str
    size: int
    replicas: list[Any]  # pb.KVReplica, each with its WRITE token
    token_expiry_ms: int


class KVStoreClient:
    def __init__(self, master_addr: str, *, num_streams: int = 4, use_shm: bool = True, rpc_timeout_s: float = 10.0,
                 max_parallel: int = 8, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        self._channel = make_channel(master_addr, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self._stub = pb_grpc.KVStoreMasterStub(self._channel)
        self._timeout = rpc_timeout_s
        self._xfer = TransferClient(num_streams=num_streams)
        self._shm = SharedRegionCache()
        self._use_shm = use_shm
        self._host_id = local_host_id()
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="kvstore-client")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._xfer.close()
        self._shm.close()
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rpc(self, method: str, req: Any) -> Any:
        try:
            return getattr(self._stub, method)(req, timeout=self._timeout)
        except grpc.RpcError as e:
            raise KVStoreError(f"kvstore master {method} failed: {e.code().name}: {e.details()}") from e

    def _map(self, fn: Any, items: Sequence[Any], replicas: Any) -> list[Any]:
        """Run fn over items (results in order): in parallel when some go over TCP, inline when
        every replica is a same-host shared-memory copy (a thread hand-off costs more than
        copying a small object)."""
        if len(items) <= 1 or all(self._local(r) for rs in replicas for r in rs):
            return [fn(x) for x in items]
        return list(self._pool.map(fn, items))

    # -- puts --------------------------------------------------------------------------------
    def put(self, key: str, src: Any, *, replica_num: int = 1, pinned: bool = False) -> Status:
        return self.batch_put([key], [src], replica_num=replica_num, pinned=pinned)[0]

    def batch_put(self, keys: Sequence[str], srcs: Sequence[Any], *, replica_num: int = 1,
                  pinned: bool = False) -> list[Status]:
        """Store each src under its key. Exactly one concurrent put of a key wins (OK); the others
        get IN_PROGRESS, later ones ALREADY_EXISTS. TRANSFER_FAILED: nothing was stored."""
        if len(keys) != len(srcs):
            raise ValueError("keys and srcs differ in length")
        views = [as_byte_view(s, writable=False) for s in srcs]
        started = self.start_puts(keys, [v.nbytes for v in views], replica_num=replica_num, pinned=pinned)
        statuses = [st for st, _ in started]
        todo = [(i, p) for i, (st, p) in enumerate(started) if p is not None]

        def write(item: tuple[int, PendingPut]) -> bool:
            try:
                self.write_put(item[1], views[item[0]])
                return True
            except (TransferError, OSError, ValueError):
                return False

        ok = self._map(write, todo, [p.replicas for _, p in todo])
        good = [p for (_, p), w in zip(todo, ok, strict=True) if w]
        bad = [p for (_, p), w in zip(todo, ok, strict=True) if not w]
        if bad:
            self.revoke_puts(bad)
        ended = dict(zip([p.key for p in good], self.end_puts(good), strict=True)) if good else {}
        bad_ids = {id(p) for p in bad}
        for i, p in todo:
            if id(p) in bad_ids or ended.get(p.key) != Status.OK:  # e.g. its node was lost meanwhile
                statuses[i] = Status.TRANSFER_FAILED
        return statuses

    def start_puts(self, keys: Sequence[str], sizes: Sequence[int], *, replica_num: int = 1,
                   pinned: bool = False) -> list[tuple[Status, PendingPut | None]]:
        """Phase 1 (advanced use: e.g. pack data straight into the returned shm placement)."""
        req = pb.KVPutStartRequest(items=[pb.KVPutItem(key=k, size=s) for k, s in zip(keys, sizes, strict=True)],
                                   replica_num=replica_num, pinned=pinned)
        out: list[tuple[Status, PendingPut | None]] = []
        for r in self._rpc("PutStart", req).results:
            st = Status(r.status)
            out.append((st, PendingPut(r.key, r.put_id, sizes[len(out)], list(r.replicas), r.token_expiry_ms)
                        if st == Status.OK else None))
        return out

    def write_put(self, p: PendingPut, src: Any) -> None:
        """Phase 2: write src to every replica; raises on the first failure."""
        view = as_byte_view(src, writable=False)
        if view.nbytes != p.size:
            raise ValueError(f"{p.key}: source has {view.nbytes} bytes, put was started for {p.size}")
        for r in p.replicas:
            if self._shm_write(r, view, p.token_expiry_ms):
                continue
            self._xfer.write((r.data_host, r.data_port), r.token, [(r.offset, r.size)], view)

    def end_puts(self, puts: Sequence[PendingPut]) -> list[Status]:
        req = pb.KVPutEndRequest(puts=[pb.KVPutRef(key=p.key, put_id=p.put_id) for p in puts])
        return [Status(s) for s in self._rpc("PutEnd", req).statuses]

    def revoke_puts(self, puts: Sequence[PendingPut]) -> list[Status]:
        req = pb.KVPutRevokeRequest(puts=[pb.KVPutRef(key=p.key, put_id=p.put_id) for p in puts])
        return [Status(s) for s in self._rpc("PutRevoke", req).statuses]

    # -- gets --------------------------------------------------------------------------------
    def get(self, key: str, dest: Any) -> int | None:
        """Read the object into dest (its first `size` bytes); returns size, or None on a miss."""
        return self.batch_get([key], [dest])[0]

    def get_bytes(self, key: str) -> bytes | None:
        res = self._rpc("GetReplicas", pb.KVGetReplicasRequest(keys=[key])).results[0]
        if res.status != Status.OK:
            return None
        buf = bytearray(res.size)
        self._read(res, memoryview(buf))
        return bytes(buf)

    def batch_get(self, keys: Sequence[str], dests: Sequence[Any]) -> list[int | None]:
        if len(keys) != len(dests):
            raise ValueError("keys and dests differ in length")
        views = [as_byte_view(d, writable=True) for d in dests]
        results = self._rpc("GetReplicas", pb.KVGetReplicasRequest(keys=list(keys))).results
        for res, v in zip(results, views, strict=True):
            if res.status == Status.OK and v.nbytes < res.size:
                raise ValueError(f"{res.key}: destination has {v.nbytes} bytes, object has {res.size}")
        hits = [(i, res) for i, res in enumerate(results) if res.status == Status.OK]

        def read(item: tuple[int, Any]) -> str | None:
            try:
                self._read(item[1], views[item[0]])
                return None
            except KVStoreError as e:
                return str(e)

        errors = self._map(read, hits, [res.replicas for _, res in hits])
        out: list[int | None] = [None] * len(keys)
        failed = []
        for (i, res), err in zip(hits, errors, strict=True):
            if err is None:
                out[i] = res.size
            else:
                failed.append(res.key)
        if failed:
            raise KVStoreError(f"could not read {len(failed)} object(s), e.g. {failed[0]}", out, failed)
        return out

    def _read(self, res: Any, view: memoryview) -> None:
        errors = []
        for r in sorted(res.replicas, key=lambda r: not self._local(r)):  # local shm first
            try:
                if self._shm_read(r, view, res.lease_expiry_ms):
                    return
                self._xfer.read((r.data_host, r.data_port), r.token, [(r.offset, r.size)], view)
                return
            except (TransferError, OSError, ValueError) as e:
                errors.append(f"{r.node_id}: {e}")
        raise KVStoreError(f"{res.key}: every replica failed: {'; '.join(errors) or 'no replicas'}")

    # -- shared memory -----------------------------------------------------------------------
    def _local(self, r: Any) -> bool:
        return self._use_shm and bool(r.shm_name) and r.host_id == self._host_id

    def _shm_read(self, r: Any, view: memoryview, expiry_ms: int) -> bool:
        if not self._local(r):
            return False
        try:
            region = self._shm.get(r.shm_name, r.segment_size, writable=False)
        except (OSError, ValueError):
            return False  # not really our /dev/shm (another container?): use TCP
        if now_ms() > expiry_ms:
            raise TransferError("expired", "read lease expired before the copy")
        view[:r.size] = region.view[r.offset:r.offset + r.size]  # one memcpy
        return True

    def _shm_write(self, r: Any, view: memoryview, expiry_ms: int) -> bool:
        if not self._local(r):
            return False
        try:
            region = self._shm.get(r.shm_name, r.segment_size, writable=True)
        except (OSError, ValueError):
            return False
        if now_ms() > expiry_ms:
            raise TransferError("expired", "write token expired before the copy")
        region.view[r.offset:r.offset + r.size] = view[:r.size]
        return True

    # -- metadata ----------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return bool(self._rpc("Exists", pb.KVExistsRequest(key=key)).exists)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return list(self._rpc("BatchExists", pb.KVBatchExistsRequest(keys=list(keys))).exists)

    def remove(self, key: str) -> bool:
        """True if the key was removed (it disappears at once; its bytes go after its leases)."""
        return self.batch_remove([key])[0] == Status.OK

    def batch_remove(self, keys: Sequence[str]) -> list[Status]:
        return [Status(s) for s in self._rpc("Remove", pb.KVRemoveRequest(keys=list(keys))).statuses]

    def stats(self) -> dict[str, float]:
        resp = self._rpc("Stats", pb.KVStatsRequest())
        out = {f.name: getattr(resp, f.name) for f in resp.DESCRIPTOR.fields if f.name != "counters"}
        out.update(resp.counters)
        return out
