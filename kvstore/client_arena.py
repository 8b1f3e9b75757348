"""Write arenas of the kvstore client: small same-host puts in one RPC per batch.

Small objects (<= max_object, 256 KiB by default: bigger ones amortise two RPCs anyway) whose
replicas are all same-host shared memory take one RPC instead of two: the client reserves a write
arena now and then (ReserveArena: a few MiB per replica, WRITE tokens for all of it, a fixed
expiry; the master caps it at a fraction of a segment), bump-allocates objects in it, copies them
in and publishes each batch with one CommitArena. Objects the commit rejects leave their space in
the arena (the master reclaims it with the arena). An arena is used for the first half of its
token lifetime only, so a copy and commit started in it finish well before it expires. Whatever
an arena does not settle (remote nodes, no room for an arena) the caller puts two-phase, so the
data-plane protocol is unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster.transfer import now_ms

from .entities import Status
from .lookup_client import LookupSession
from .master_rpc import KVStoreError, MasterRPC
from .object_mac import object_mac
from .replica_io import ReplicaIO

ARENA_RETRY_MS = 5000  # after an arena could not be used (no room, remote replicas): two-phase for a while
PAGE = 4096  # a fresh arena is sized for the rest of the batch in whole pages


@dataclass
class WriteArena:
    """Client side of one write arena: the bump pointer (guarded by WriteArenas' lock)."""

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
        offset, self.next = self.next, self.next + need
        return offset

    def write(self, offset: int, view: memoryview) -> bool:
        if now_ms() > self.expiry_ms:  # the shm path has no token check: ours is the only one
            return False
        nbytes = view.nbytes
        try:
            for segment, base in self.targets:
                segment[base + offset:base + offset + nbytes] = view  # one memcpy per replica
        except ValueError:  # the mapping was released (client closing)
            return False
        return True


Slots = list[tuple[int, int]]  # (index in the batch, offset in the arena)


class WriteArenas:
    """This client's arenas, one per replica_num; arena_bytes=0 turns them off."""

    def __init__(self, master: MasterRPC, replica_io: ReplicaIO, *, arena_bytes: int = 8 << 20,
                 max_object: int = 256 << 10, object_key: bytes | None = None,
                 lookup: LookupSession | None = None) -> None:
        self._object_key = object_key  # MAC each object under it (object_mac.py)
        self._master = master
        self._lookup = lookup  # a LookupSession: commits over the master's same-host socket (lookup_client.py)
        self._replica_io = replica_io
        self._arena_bytes = arena_bytes
        self.max_object = min(max_object, arena_bytes)
        self._lock = threading.Lock()
        self._arenas: dict[int, WriteArena] = {}
        self._off_until: dict[int, int] = {}
        self._cap: dict[int, int] = {}  # per replica_num: the largest arena the master grants

    @property
    def enabled(self) -> bool:
        return self._replica_io.use_shm and self._arena_bytes > 0

    def close(self) -> None:
        with self._lock:
            arenas, self._arenas = list(self._arenas.values()), {}
        for arena in arenas:  # hand the unused rest back now (it is reused after the arena's expiry + grace)
            try:
                self._master.call("ReleaseArena", pb.KVReleaseArenaRequest(arena_id=arena.arena_id))
            except KVStoreError:
                pass  # the master reclaims it at expiry anyway

    def put(self, keys: Sequence[str], views: list[memoryview], indices: list[int], replica_num: int,
            pinned: bool) -> dict[int, Status]:
        """Put views[i] for i in indices through arenas. Returns the status of each key it settled;
        keys it did not (no arena, copy failed, arena gone before the commit) go two-phase."""
        done: dict[int, Status] = {}
        for arena, slots in self._carve([(i, views[i].nbytes) for i in indices], replica_num):
            written = [(i, offset) for i, offset in slots if arena.write(offset, views[i])]
            if len(written) < len(slots):  # expired (a stalled process) or closing: the next batch reserves anew
                self._drop(arena, replica_num)
            if not written:
                continue
            request = pb.KVCommitArenaRequest(arena_id=arena.arena_id, pinned=pinned)
            add = request.items.add  # cheaper than building each item from keyword arguments
            for i, offset in written:
                if self._object_key is None:
                    add(key=keys[i], offset=offset, size=views[i].nbytes)
                else:
                    add(key=keys[i], offset=offset, size=views[i].nbytes,
                        mac=object_mac(self._object_key, keys[i], views[i]))
            response = self._lookup.commit_arena(request) if self._lookup is not None else None
            if response is None:  # no same-host session now (lookup_client.py): gRPC
                response = self._master.call("CommitArena", request)
            if response.status != Status.OK:  # expired, or lost with a node (or a master without it)
                self._drop(arena, replica_num)
                continue
            for (i, _), status in zip(written, response.statuses, strict=True):
                if status != Status.NOT_FOUND:
                    done[i] = Status(status)
        return done

    def _carve(self, items: list[tuple[int, int]], replica_num: int) -> list[tuple[WriteArena, Slots]]:
        """Bump-allocate (index, nbytes) items in the arena for replica_num, reserving a fresh
        arena when it is full or past its use-by time. Returns (arena, [(index, offset)]) groups
        in order; items left out (no arena to be had) go two-phase."""
        groups: list[tuple[WriteArena, Slots]] = []
        with self._lock:
            if now_ms() < self._off_until.get(replica_num, 0):
                return groups
            arena: WriteArena | None = self._arenas.get(replica_num)
            if arena is not None and now_ms() >= arena.use_until_ms:
                arena = None  # no release: its rest comes back at expiry + grace either way
            slots: Slots = []
            cap = self._cap.get(replica_num)
            for k, (i, nbytes) in enumerate(items):
                if cap is not None and nbytes > cap:
                    continue  # no arena the master grants can hold it: two-phase
                offset = arena.carve(nbytes) if arena is not None else None
                if offset is None:
                    if arena is not None and slots:
                        groups.append((arena, slots))
                    slots = []
                    arena = self._reserve(sum(-(-n // PAGE) * PAGE for _, n in items[k:]), replica_num)
                    if arena is None:
                        break
                    cap = self._cap.get(replica_num)
                    offset = arena.carve(nbytes)
                    if offset is None:  # bigger than the arena the master granted: two-phase
                        continue
                slots.append((i, offset))
            if arena is not None and slots:
                groups.append((arena, slots))
            if arena is None:
                self._arenas.pop(replica_num, None)
            else:
                self._arenas[replica_num] = arena
        return groups

    def _reserve(self, need: int, replica_num: int) -> WriteArena | None:
        """Called under the lock. Tries a full-size arena, then one just big enough."""
        sizes = [max(self._arena_bytes, min(need, 4 * self._arena_bytes))]
        if need < sizes[0]:
            sizes.append(need)
        for size in sizes:
            response = self._master.call("ReserveArena", pb.KVReserveArenaRequest(size=size, replica_num=replica_num))
            if response.status == Status.OK:
                if response.size < size:  # capped by the master (a small store): remember, so bigger
                    self._cap[replica_num] = response.size  # objects stop asking for arenas
                break
        else:
            self._off_until[replica_num] = now_ms() + ARENA_RETRY_MS
            return None
        targets = []
        try:
            for replica in response.replicas:
                if not self._replica_io.local(replica):
                    raise ValueError("remote replica")
                # The arena holds the mapping: a replaced cache entry stays mapped while we use it.
                targets.append((self._replica_io.map_writable(replica), replica.offset))
        except (OSError, ValueError):  # remote (or not really shared) replicas: two-phase is their path
            self._master.call("ReleaseArena", pb.KVReleaseArenaRequest(arena_id=response.arena_id))
            self._off_until[replica_num] = now_ms() + ARENA_RETRY_MS
            return None
        now = now_ms()
        return WriteArena(response.arena_id, response.size, response.align, targets, response.token_expiry_ms,
                          now + (response.token_expiry_ms - now) // 2)

    def _drop(self, arena: WriteArena, replica_num: int) -> None:
        with self._lock:
            if self._arenas.get(replica_num) is arena:  # another thread may have replaced it already
                del self._arenas[replica_num]


__all__ = ["ARENA_RETRY_MS", "WriteArena", "WriteArenas"]
