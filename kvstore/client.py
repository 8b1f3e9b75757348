"""KVStoreClient: put/get objects into and out of caller-provided buffers (zero-copy).

    client = KVStoreClient("127.0.0.1:50070")
    client.put("k", tensor)                 # Status.OK / ALREADY_EXISTS / IN_PROGRESS / NO_SPACE / ...
    n = client.get("k", out_tensor)         # bytes read, or None on a miss

Puts are two-phase: PutStart (master allocates, returns WRITE tokens) -> the bytes go straight
from the caller's buffer to every replica -> PutEnd publishes. If any replica write fails the
put is revoked, so a partial object is never visible. Gets take a lease (the master keeps the
bytes until it expires) and read one replica, trying the next on failure.

Small objects (<= arena_max_object, 256 KiB by default: bigger ones amortise two RPCs anyway)
whose replicas are all same-host shared memory take one RPC instead of two: the client reserves a
write arena now and then (ReserveArena: a few MiB per replica, WRITE tokens for all of it, a fixed
expiry; the master caps it at a fraction of a segment), bump-allocates objects in it, copies them
in and publishes each batch with one CommitArena. Objects the commit rejects leave their space in
the arena (the master reclaims it with the arena). An arena is used for the first half of its
token lifetime only, so a copy and commit started in it finish well before it expires. Anything
else (remote nodes, use_shm=False, big objects, no room for an arena) takes the two-phase path,
so the data-plane protocol is unchanged.

Path per replica: same host (host id match) and shared segment -> map it and memcpy; otherwise
the TCP data plane with several streams. A shared-memory attempt that fails falls back to TCP.
The shm path skips the node's token check (the OS file mode is the guard), so the client checks
the token/lease expiry itself before copying; the master's grace period covers the copy. Gets
therefore tell the master our host id and get no READ tokens for replicas on it; if such a copy
fails the client asks again with tokens (and from then on always asks with tokens).
"""

from __future__ import annotations

import threading
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


@dataclass
class _Arena:
    """Client side of a write arena: the bump pointer (guarded by KVStoreClient._arena_lock)."""

    arena_id: str
    size: int
    align: int
    targets: list[tuple[memoryview, int]]  # per replica: its mapped segment and the arena's offset in it
    expiry_ms: int
    use_until_ms: int  # carve nothing after this: the copies and the commit need the rest of the life
    next: int = 0

    def carve(self, nbytes: int) -> int | None:
        need = max(self.align, -(-nbytes // self.align) * self.align)
        if self.next + need > self.size:
            return None
        off, self.next = self.next, self.next + need
        return off


ARENA_RETRY_MS = 5000  # after an arena could not be used (no room, remote replicas): two-phase for a while


class KVStoreClient:
    def __init__(self, master_addr: str, *, num_streams: int = 4, use_shm: bool = True, rpc_timeout_s: float = 10.0,
                 max_parallel: int = 8, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, arena_bytes: int = 8 << 20, arena_max_object: int = 256 << 10) -> None:
        self._channel = make_channel(master_addr, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self._stub = pb_grpc.KVStoreMasterStub(self._channel)
        self._timeout = rpc_timeout_s
        self._xfer = TransferClient(num_streams=num_streams)
        self._shm = SharedRegionCache()
        self._use_shm = use_shm
        self._tokenless_gets = use_shm  # see _get_replicas
        # (shm name, size) -> read view of a segment _shm_read mapped (the view keeps it mapped).
        self._read_maps: dict[tuple[str, int], memoryview] = {}
        self._host_id = local_host_id()
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="kvstore-client")
        # Write arenas, one per replica_num; arena_bytes=0 turns them off.
        self._arena_bytes = arena_bytes
        self._arena_max_object = min(arena_max_object, arena_bytes)
        self._arena_lock = threading.Lock()
        self._arenas: dict[int, _Arena] = {}
        self._arena_off_until: dict[int, int] = {}
        self._arena_cap: dict[int, int] = {}  # per replica_num: the largest arena the master grants

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._read_maps.clear()
        with self._arena_lock:
            arenas, self._arenas = list(self._arenas.values()), {}
        for a in arenas:  # hand the unused rest back now (it is reused after the arena's expiry + grace)
            try:
                self._rpc("ReleaseArena", pb.KVReleaseArenaRequest(arena_id=a.arena_id))
            except KVStoreError:
                pass  # the master reclaims it at expiry anyway
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
        statuses: list[Status | None] = [None] * len(keys)
        if self._use_shm and self._arena_bytes > 0:
            small = [i for i, v in enumerate(views) if 0 < v.nbytes <= self._arena_max_object]
            if small:
                for i, st in self._arena_put(keys, views, small, replica_num, pinned).items():
                    statuses[i] = st
        rest = [i for i, st in enumerate(statuses) if st is None]
        if rest:
            two = self._two_phase_put([keys[i] for i in rest], [views[i] for i in rest], replica_num, pinned)
            for i, st in zip(rest, two, strict=True):
                statuses[i] = st
        return [st if st is not None else Status.TRANSFER_FAILED for st in statuses]

    def _two_phase_put(self, keys: Sequence[str], views: list[memoryview], replica_num: int,
                       pinned: bool) -> list[Status]:
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

    # -- arena puts (one RPC per batch) ---------------------------------------------------------
    def _arena_put(self, keys: Sequence[str], views: list[memoryview], idx: list[int], replica_num: int,
                   pinned: bool) -> dict[int, Status]:
        """Put views[i] for i in idx through arenas. Returns the status of each key it settled;
        keys it did not (no arena, copy failed, arena gone before the commit) go two-phase."""
        done: dict[int, Status] = {}
        for arena, slots in self._carve([(i, views[i].nbytes) for i in idx], replica_num):
            written = [(i, off) for i, off in slots if self._arena_write(arena, off, views[i])]
            if len(written) < len(slots):  # expired (a stalled process) or closing: the next batch reserves anew
                self._drop_arena(arena, replica_num)
            if not written:
                continue
            req = pb.KVCommitArenaRequest(arena_id=arena.arena_id, pinned=pinned)
            add = req.items.add  # cheaper than building each item from keyword arguments
            for i, off in written:
                add(key=keys[i], offset=off, size=views[i].nbytes)
            resp = self._rpc("CommitArena", req)
            if resp.status != Status.OK:  # expired, or lost with a node (or a master without it)
                self._drop_arena(arena, replica_num)
                continue
            for (i, _), st in zip(written, resp.statuses, strict=True):
                if st != Status.NOT_FOUND:
                    done[i] = Status(st)
        return done

    def _carve(self, items: list[tuple[int, int]], replica_num: int) -> list[tuple[_Arena, list[tuple[int, int]]]]:
        """Bump-allocate (index, nbytes) items in this client's arena for replica_num, reserving a
        fresh arena when it is full or past its use-by time. Returns (arena, [(index, offset)])
        groups in order; items left out (no arena to be had) go two-phase."""
        groups: list[tuple[_Arena, list[tuple[int, int]]]] = []
        with self._arena_lock:
            if now_ms() < self._arena_off_until.get(replica_num, 0):
                return groups
            arena: _Arena | None = self._arenas.get(replica_num)
            if arena is not None and now_ms() >= arena.use_until_ms:
                arena = None  # no release: its rest comes back at expiry + grace either way
            slots: list[tuple[int, int]] = []
            cap = self._arena_cap.get(replica_num)
            for k, (i, nbytes) in enumerate(items):
                if cap is not None and nbytes > cap:
                    continue  # no arena the master grants can hold it: two-phase
                off = arena.carve(nbytes) if arena is not None else None
                if off is None:
                    if arena is not None and slots:
                        groups.append((arena, slots))
                    slots = []
                    arena = self._reserve_arena(sum(-(-n // 4096) * 4096 for _, n in items[k:]), replica_num)
                    if arena is None:
                        break
                    cap = self._arena_cap.get(replica_num)
                    off = arena.carve(nbytes)
                    if off is None:  # bigger than the arena the master granted: two-phase
                        continue
                slots.append((i, off))
            if arena is not None and slots:
                groups.append((arena, slots))
            if arena is None:
                self._arenas.pop(replica_num, None)
            else:
                self._arenas[replica_num] = arena
        return groups

    def _reserve_arena(self, need: int, replica_num: int) -> _Arena | None:
        """Called under _arena_lock. Tries a full-size arena, then one just big enough."""
        sizes = [max(self._arena_bytes, min(need, 4 * self._arena_bytes))]
        if need < sizes[0]:
            sizes.append(need)
        for size in sizes:
            resp = self._rpc("ReserveArena", pb.KVReserveArenaRequest(size=size, replica_num=replica_num))
            if resp.status == Status.OK:
                if resp.size < size:  # capped by the master (a small store): remember, so bigger
                    self._arena_cap[replica_num] = resp.size  # objects stop asking for arenas
                break
        else:
            self._arena_off_until[replica_num] = now_ms() + ARENA_RETRY_MS
            return None
        targets = []
        try:
            for r in resp.replicas:
                if not self._local(r):
                    raise ValueError("remote replica")
                # The arena holds the mapping: a replaced cache entry stays mapped while we use it.
                targets.append((self._shm.get(r.shm_name, r.segment_size, writable=True).view, r.offset))
        except (OSError, ValueError):  # remote (or not really shared) replicas: two-phase is their path
            self._rpc("ReleaseArena", pb.KVReleaseArenaRequest(arena_id=resp.arena_id))
            self._arena_off_until[replica_num] = now_ms() + ARENA_RETRY_MS
            return None
        now = now_ms()
        return _Arena(resp.arena_id, resp.size, resp.align, targets, resp.token_expiry_ms,
                      now + (resp.token_expiry_ms - now) // 2)

    def _drop_arena(self, arena: _Arena, replica_num: int) -> None:
        with self._arena_lock:
            if self._arenas.get(replica_num) is arena:  # another thread may have replaced it already
                del self._arenas[replica_num]

    def _arena_write(self, arena: _Arena, off: int, view: memoryview) -> bool:
        if now_ms() > arena.expiry_ms:  # the shm path has no token check: ours is the only one
            return False
        n = view.nbytes
        try:
            for dst, base in arena.targets:
                dst[base + off:base + off + n] = view  # one memcpy per replica
        except ValueError:  # the mapping was released (client closing)
            return False
        return True

    def start_puts(self, keys: Sequence[str], sizes: Sequence[int], *, replica_num: int = 1,
                   pinned: bool = False) -> list[tuple[Status, PendingPut | None]]:
        """Phase 1 (advanced use: e.g. pack data straight into the returned shm placement)."""
        req = pb.KVPutStartRequest(replica_num=replica_num, pinned=pinned)
        add = req.items.add
        for k, s in zip(keys, sizes, strict=True):
            add(key=k, size=s)
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

    def _get_replicas(self, keys: Sequence[str], tokens_for_all: bool = False) -> Any:
        """Replicas on our host that we copy through shared memory come without tokens (the
        master skips minting them) unless tokens_for_all, or once mapping a segment failed."""
        shm_host = "" if tokens_for_all or not self._tokenless_gets else self._host_id
        return self._rpc("GetReplicas", pb.KVGetReplicasRequest(keys=list(keys), shm_host_id=shm_host)).results

    def get_bytes(self, key: str) -> bytes | None:
        res = self._get_replicas([key])[0]
        if res.status != Status.OK:
            return None
        buf = bytearray(res.size)
        self._read(res, memoryview(buf))
        return bytes(buf)

    def batch_get(self, keys: Sequence[str], dests: Sequence[Any]) -> list[int | None]:
        if len(keys) != len(dests):
            raise ValueError("keys and dests differ in length")
        views = [as_byte_view(d, writable=True) for d in dests]
        results = self._get_replicas(keys)
        out: list[int | None] = [None] * len(keys)
        hits = []
        for i, (res, v) in enumerate(zip(results, views, strict=True)):
            if res.status == Status.OK:
                size = res.size
                if v.nbytes < size:
                    raise ValueError(f"{res.key}: destination has {v.nbytes} bytes, object has {size}")
                hits.append((i, res, size))
        # Fast path: the first replica is ours to copy through shared memory (the per-key Python
        # work here is a large part of a small-object get). Anything else goes through _read.
        rest = []
        for i, res, size in hits:
            r = res.replicas[0] if len(res.replicas) else None
            src = self._read_maps.get((r.shm_name, r.segment_size)) if r is not None else None
            if src is None or r.host_id != self._host_id or now_ms() > res.lease_expiry_ms:
                rest.append((i, res, size))
                continue
            off = r.offset
            views[i][:size] = src[off:off + size]  # one memcpy
            out[i] = size

        def read(item: tuple[int, Any, int]) -> str | None:
            try:
                self._read(item[1], views[item[0]])
                return None
            except KVStoreError as e:
                return str(e)

        errors = self._map(read, rest, [res.replicas for _, res, _ in rest]) if rest else []
        failed = []
        for (i, res, size), err in zip(rest, errors, strict=True):
            if err is None:
                out[i] = size
            else:
                failed.append(res.key)
        if failed:
            raise KVStoreError(f"could not read {len(failed)} object(s), e.g. {failed[0]}", out, failed)
        return out

    def _read(self, res: Any, view: memoryview, ask_tokens: bool = True) -> None:
        errors = []
        for r in sorted(res.replicas, key=lambda r: not self._local(r)):  # local shm first
            try:
                if self._shm_read(r, view, res.lease_expiry_ms):
                    return
                if not r.token:
                    errors.append(f"{r.node_id}: shared memory unusable and no token")
                    continue
                self._xfer.read((r.data_host, r.data_port), r.token, [(r.offset, r.size)], view)
                return
            except (TransferError, OSError, ValueError) as e:
                errors.append(f"{r.node_id}: {e}")
        if ask_tokens and any(not r.token for r in res.replicas):
            # Shared memory failed (or the lease ran out): ask again, with tokens for every replica.
            fresh = self._get_replicas([res.key], tokens_for_all=True)[0]
            if fresh.status == Status.OK and fresh.size == res.size:
                return self._read(fresh, view, ask_tokens=False)
        raise KVStoreError(f"{res.key}: every replica failed: {'; '.join(errors) or 'no replicas'}")

    # -- shared memory -----------------------------------------------------------------------
    def _local(self, r: Any) -> bool:
        return self._use_shm and bool(r.shm_name) and r.host_id == self._host_id

    def _shm_read(self, r: Any, view: memoryview, expiry_ms: int) -> bool:
        if not self._local(r):
            return False
        try:
            region = self._shm.get(r.shm_name, r.segment_size, writable=False)
            self._read_maps[(r.shm_name, r.segment_size)] = region.view  # for batch_get's fast path
        except (OSError, ValueError):
            # Not really our /dev/shm (another container?): use TCP, and from now on ask for
            # tokens up front instead of asking twice per get.
            self._tokenless_gets = False
            return False
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
