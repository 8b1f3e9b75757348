"""KVStoreClient: put/get objects into and out of caller-provided buffers (zero-copy).

    client = KVStoreClient("127.0.0.1:50070")  # or "primary:50070,standby:50071" (kvstore/standby.py)
    client.put("k", tensor)                 # Status.OK / ALREADY_EXISTS / IN_PROGRESS / NO_SPACE / ...
    n = client.get("k", out_tensor)         # bytes read, or None on a miss

This is the facade over the master's RPCs. Puts are two-phase: PutStart (master allocates,
returns WRITE tokens) -> the bytes go straight from the caller's buffer to every replica -> PutEnd
publishes. If any replica write fails the put is revoked, so a partial object is never visible.
Gets take a lease (the master keeps the bytes until it expires) and read one replica, trying the
next on failure. Small same-host puts take one RPC per batch instead (client_arena.py); how bytes
reach a replica (shared memory or TCP) is replica_io.py; the master connection is master_rpc.py,
and same-host lookups skip gRPC over the master's lookup socket (lookup_client.py).

Integrity: with an `object_key` (the store key the workers share, object_mac.py) every put MACs
its object and the master records the MAC with it; every get checks the bytes it read against
the recorded MAC and reports a mismatch (or a missing MAC) as a failed read, never as data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster.transfer import TransferError

from .byte_views import byte_view, byte_views
from .client_arena import WriteArenas
from .entities import Status
from .lookup_client import LookupSession
from .master_rpc import KVStoreError, MasterRPC
from .object_mac import check_store_key, mac_matches, object_mac
from .replica_io import Hit, ReplicaIO


@dataclass
class PendingPut:
    key: str
    put_id: str
    size: int
    replicas: list[pb.KVReplica]  # each with its WRITE token
    token_expiry_ms: int
    mac: bytes = b""  # set by write_put when the client has an object key


class KVStoreClient:
    def __init__(self, master_addr: str | Sequence[str], *, num_streams: int = 4, use_shm: bool = True, rpc_timeout_s: float = 10.0,
                 max_parallel: int = 8, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, arena_bytes: int = 8 << 20, arena_max_object: int = 256 << 10,
                 object_key: bytes | str | None = None, io_timeout_s: float | None = None,
                 lookup_socket: bool | None = None) -> None:
        # lookup_socket: GetReplicas over the master's same-host Unix socket when it offers one
        # (kvstore/lookup_client.py; gRPC otherwise); default: when copying through shared memory
        self._object_key = check_store_key(object_key)
        self._master = MasterRPC(master_addr, timeout_s=rpc_timeout_s, tls_ca=tls_ca, tls_cert=tls_cert,
                                 tls_key=tls_key)
        self._replica_io = ReplicaIO(num_streams=num_streams, use_shm=use_shm, max_parallel=max_parallel,
                                     io_timeout_s=rpc_timeout_s if io_timeout_s is None else io_timeout_s)
        use_lookup = use_shm if lookup_socket is None else lookup_socket
        self._lookup = LookupSession(self._master, self._replica_io.host_id, timeout_s=min(rpc_timeout_s, 5.0),
                                     commit_timeout_s=rpc_timeout_s) if use_lookup else None
        self._arenas = WriteArenas(self._master, self._replica_io, arena_bytes=arena_bytes, max_object=arena_max_object,
                                   object_key=self._object_key, lookup=self._lookup)
        self.counters = {"mac_mismatches": 0}
        self.lookup_counters = self._lookup.counters if self._lookup is not None else {}

    def close(self) -> None:
        if self._lookup is not None:
            self._lookup.close()
        self._arenas.close()
        self._replica_io.close()
        self._master.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- puts --------------------------------------------------------------------------------
    def put(self, key: str, src: Any, *, replica_num: int = 1, pinned: bool = False) -> Status:
        return self.batch_put([key], [src], replica_num=replica_num, pinned=pinned)[0]

    def batch_put(self, keys: Sequence[str], srcs: Sequence[Any], *, replica_num: int = 1,
                  pinned: bool = False) -> list[Status]:
        """Store each src under its key. Exactly one concurrent put of a key wins (OK); the others
        get IN_PROGRESS, later ones ALREADY_EXISTS. TRANSFER_FAILED: nothing was stored."""
        if len(keys) != len(srcs):
            raise ValueError("keys and srcs differ in length")
        views = byte_views(srcs, writable=False)
        statuses: list[Status | None] = [None] * len(keys)
        if self._arenas.enabled:
            small = [i for i, v in enumerate(views) if 0 < v.nbytes <= self._arenas.max_object]
            if small:
                for i, status in self._arenas.put(keys, views, small, replica_num, pinned).items():
                    statuses[i] = status
        rest = [i for i, status in enumerate(statuses) if status is None]
        if rest:
            two = self._two_phase_put([keys[i] for i in rest], [views[i] for i in rest], replica_num, pinned)
            for i, status in zip(rest, two, strict=True):
                statuses[i] = status
        return [status if status is not None else Status.TRANSFER_FAILED for status in statuses]

    def _two_phase_put(self, keys: Sequence[str], views: list[memoryview], replica_num: int,
                       pinned: bool) -> list[Status]:
        started = self.start_puts(keys, [v.nbytes for v in views], replica_num=replica_num, pinned=pinned)
        statuses = [status for status, _ in started]
        todo = [(i, put) for i, (_, put) in enumerate(started) if put is not None]

        def write(item: tuple[int, PendingPut]) -> bool:
            try:
                self.write_put(item[1], views[item[0]])
                return True
            except (TransferError, OSError, ValueError):
                return False

        written = self._replica_io.map_each(write, todo, [put.replicas for _, put in todo])
        good = [put for (_, put), ok in zip(todo, written, strict=True) if ok]
        bad = [put for (_, put), ok in zip(todo, written, strict=True) if not ok]
        if bad:
            self.revoke_puts(bad)
        ended = dict(zip([put.key for put in good], self.end_puts(good), strict=True)) if good else {}
        bad_ids = {id(put) for put in bad}
        for i, put in todo:
            if id(put) in bad_ids or ended.get(put.key) != Status.OK:  # e.g. its node was lost meanwhile
                statuses[i] = Status.TRANSFER_FAILED
        return statuses

    def start_puts(self, keys: Sequence[str], sizes: Sequence[int], *, replica_num: int = 1,
                   pinned: bool = False) -> list[tuple[Status, PendingPut | None]]:
        """Phase 1 (advanced use: e.g. pack data straight into the returned shm placement)."""
        request = pb.KVPutStartRequest(replica_num=replica_num, pinned=pinned)
        add = request.items.add
        for key, size in zip(keys, sizes, strict=True):
            add(key=key, size=size)
        out: list[tuple[Status, PendingPut | None]] = []
        for result in self._master.call("PutStart", request).results:
            status = Status(result.status)
            out.append((status, PendingPut(result.key, result.put_id, sizes[len(out)], list(result.replicas),
                                           result.token_expiry_ms) if status == Status.OK else None))
        return out

    def write_put(self, put: PendingPut, src: Any) -> None:
        """Phase 2: write src to every replica; raises on the first failure."""
        view = byte_view(src, writable=False)
        if view.nbytes != put.size:
            raise ValueError(f"{put.key}: source has {view.nbytes} bytes, put was started for {put.size}")
        if self._object_key is not None:
            put.mac = object_mac(self._object_key, put.key, view)
        for replica in put.replicas:
            self._replica_io.write(replica, view, put.token_expiry_ms)

    def end_puts(self, puts: Sequence[PendingPut]) -> list[Status]:
        request = pb.KVPutEndRequest(puts=[pb.KVPutRef(key=put.key, put_id=put.put_id, mac=put.mac) for put in puts])
        return [Status(s) for s in self._master.call("PutEnd", request).statuses]

    def revoke_puts(self, puts: Sequence[PendingPut]) -> list[Status]:
        request = pb.KVPutRevokeRequest(puts=[pb.KVPutRef(key=put.key, put_id=put.put_id) for put in puts])
        return [Status(s) for s in self._master.call("PutRevoke", request).statuses]

    # -- gets --------------------------------------------------------------------------------
    def get(self, key: str, dest: Any) -> int | None:
        """Read the object into dest (its first `size` bytes); returns size, or None on a miss."""
        return self.batch_get([key], [dest])[0]

    def _get_replicas(self, keys: Sequence[str], tokens_for_all: bool = False) -> Sequence[pb.KVGetReplicasResult]:
        """Replicas on our host that we copy through shared memory come without tokens (the
        master skips minting them) unless tokens_for_all, or once mapping a segment failed."""
        shm_host = "" if tokens_for_all or not self._replica_io.tokenless_gets else self._replica_io.host_id
        request = pb.KVGetReplicasRequest(keys=list(keys), shm_host_id=shm_host)
        if self._lookup is not None:
            resp = self._lookup.get_replicas(request)  # None: no session now, ask over gRPC
            if resp is not None:
                return resp.results
        return self._master.call("GetReplicas", request).results

    def get_bytes(self, key: str) -> bytes | None:
        result = self._get_replicas([key])[0]
        if result.status != Status.OK:
            return None
        buf = bytearray(result.size)
        self._read(result, memoryview(buf))
        if not self._verified(result, memoryview(buf)):
            raise KVStoreError(f"{key}: object MAC mismatch (the bytes read are not the bytes written)")
        return bytes(buf)

    def batch_get(self, keys: Sequence[str], dests: Sequence[Any]) -> list[int | None]:
        if len(keys) != len(dests):
            raise ValueError("keys and dests differ in length")
        views = byte_views(dests, writable=True)
        results = self._get_replicas(keys)
        out: list[int | None] = [None] * len(keys)
        hits: list[Hit] = []
        for i, (result, view) in enumerate(zip(results, views, strict=True)):
            if result.status == Status.OK:
                size = result.size
                if view.nbytes < size:
                    raise ValueError(f"{result.key}: destination has {view.nbytes} bytes, object has {size}")
                hits.append((i, result, size))
        rest = self._replica_io.read_mapped(hits, views, out)

        def read(hit: Hit) -> str | None:
            try:
                self._read(hit[1], views[hit[0]])
                return None
            except KVStoreError as e:
                return str(e)

        errors = self._replica_io.map_each(read, rest, [result.replicas for _, result, _ in rest]) if rest else []
        failed = []
        for (i, result, size), error in zip(rest, errors, strict=True):
            if error is None:
                out[i] = size
            else:
                failed.append(result.key)
        if self._object_key is not None:
            for i, result, size in hits:
                if out[i] is not None and not self._verified(result, views[i][:size]):
                    out[i] = None
                    failed.append(result.key)
        if failed:
            raise KVStoreError(f"could not read {len(failed)} object(s), e.g. {failed[0]}", out, failed)
        return out

    def _read(self, result: pb.KVGetReplicasResult, view: memoryview, ask_tokens: bool = True) -> None:
        error = self._replica_io.read(result, view)
        if error is None:
            return None
        if ask_tokens and any(not replica.token for replica in result.replicas):
            # Shared memory failed (or the lease ran out): ask again, with tokens for every replica.
            fresh = self._get_replicas([result.key], tokens_for_all=True)[0]
            if fresh.status == Status.OK and fresh.size == result.size:
                return self._read(fresh, view, ask_tokens=False)
        raise KVStoreError(f"{result.key}: every replica failed: {error}")

    def _verified(self, result: pb.KVGetReplicasResult, view: memoryview) -> bool:
        """The bytes read match the MAC the master recorded (always true without an object key)."""
        if self._object_key is None or mac_matches(self._object_key, result.key, view, result.mac):
            return True
        self.counters["mac_mismatches"] += 1
        return False

    # -- metadata ----------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return bool(self._master.call("Exists", pb.KVExistsRequest(key=key)).exists)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return list(self._master.call("BatchExists", pb.KVBatchExistsRequest(keys=list(keys))).exists)

    def remove(self, key: str) -> bool:
        """True if the key was removed (it disappears at once; its bytes go after its leases)."""
        return self.batch_remove([key])[0] == Status.OK

    def batch_remove(self, keys: Sequence[str]) -> list[Status]:
        return [Status(s) for s in self._master.call("Remove", pb.KVRemoveRequest(keys=list(keys))).statuses]

    def stats(self) -> dict[str, float]:
        response = self._master.call("Stats", pb.KVStatsRequest())
        out = {f.name: getattr(response, f.name) for f in response.DESCRIPTOR.fields if f.name != "counters"}
        out.update(response.counters)
        return out


__all__ = ["KVStoreClient", "KVStoreError", "PendingPut"]
