"""Replica I/O of the kvstore client: the bytes of one object to and from its replicas.

Path per replica: same host (host id match) and shared segment -> map it and memcpy; otherwise
the TCP data plane with several streams. A shared-memory attempt that fails falls back to TCP.
The shm path skips the node's token check (the OS file mode is the guard), so the copy checks
the token/lease expiry itself first; the master's grace period covers the copy. Gets therefore
tell the master our host id and get no READ tokens for replicas on it (`tokenless_gets`); once
mapping a segment fails, the client asks with tokens from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster.transfer import SharedRegionCache, TransferClient, TransferError, local_host_id, now_ms

Item = TypeVar("Item")
Result = TypeVar("Result")

# A hit of a batch get: (index in the batch, the master's answer for it, object size).
Hit = tuple[int, pb.KVGetReplicasResult, int]


class ReplicaIO:
    def __init__(self, *, num_streams: int = 4, use_shm: bool = True, max_parallel: int = 8,
                 io_timeout_s: float = 30.0) -> None:
        self.use_shm = use_shm
        self.tokenless_gets = use_shm
        self.host_id = local_host_id()
        # A stalled storage node must fail a read within the client's bound, not the data plane's
        # 30 s default: io_timeout_s is the longest a socket operation may wait for progress.
        self._transfer = TransferClient(num_streams=num_streams, io_timeout_s=io_timeout_s)
        self._shm = SharedRegionCache()
        # (shm name, size) -> read view of a segment a read mapped (the view keeps it mapped).
        self._read_maps: dict[tuple[str, int], memoryview] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="kvstore-client")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._read_maps.clear()
        self._transfer.close()
        self._shm.close()

    def local(self, replica: pb.KVReplica) -> bool:
        """The replica is a shared segment on this host, and we may map it."""
        return self.use_shm and bool(replica.shm_name) and replica.host_id == self.host_id

    def map_each(self, work: Callable[[Item], Result], items: Sequence[Item],
                 replica_lists: Sequence[Sequence[pb.KVReplica]]) -> list[Result]:
        """Run `work` over items (results in order): in parallel when some go over TCP, inline
        when every replica is a same-host shared-memory copy (a thread hand-off costs more than
        copying a small object)."""
        if len(items) <= 1 or all(self.local(r) for replicas in replica_lists for r in replicas):
            return [work(x) for x in items]
        return list(self._pool.map(work, items))

    def map_writable(self, replica: pb.KVReplica) -> memoryview:
        """A writable view of the replica's whole segment (OSError/ValueError: not mappable)."""
        return self._shm.get(replica.shm_name, replica.segment_size, writable=True).view

    # -- one replica -------------------------------------------------------------------------
    def shm_copy(self, replica: pb.KVReplica, view: memoryview, expiry_ms: int, *, write: bool) -> bool:
        """Copy the replica's bytes between `view` and its same-host segment (into the segment
        when `write`). False: not ours to map, take TCP. Raises when the token/lease expired."""
        if not self.local(replica):
            return False
        try:
            region = self._shm.get(replica.shm_name, replica.segment_size, writable=write)
        except (OSError, ValueError):
            if not write:
                # Not really our /dev/shm (another container?): use TCP, and from now on ask
                # for tokens up front instead of asking twice per get.
                self.tokenless_gets = False
            return False
        if not write:
            self._read_maps[(replica.shm_name, replica.segment_size)] = region.view  # for read_mapped
        if now_ms() > expiry_ms:
            what = "write token" if write else "read lease"
            raise TransferError("expired", f"{what} expired before the copy")
        start, end = replica.offset, replica.offset + replica.size
        if write:
            region.view[start:end] = view[:replica.size]
        else:
            view[:replica.size] = region.view[start:end]  # one memcpy
        return True

    def write(self, replica: pb.KVReplica, view: memoryview, expiry_ms: int) -> None:
        """Write the replica's bytes from `view` (shm, else TCP); raises on failure."""
        if not self.shm_copy(replica, view, expiry_ms, write=True):
            self._transfer.write((replica.data_host, replica.data_port), replica.token,
                                 [(replica.offset, replica.size)], view)

    # -- one object --------------------------------------------------------------------------
    def read(self, result: pb.KVGetReplicasResult, view: memoryview) -> str | None:
        """Read the object from the first replica that works, local shared memory first.
        None on success, else what went wrong with each replica."""
        errors = []
        for replica in sorted(result.replicas, key=lambda r: not self.local(r)):
            try:
                if self.shm_copy(replica, view, result.lease_expiry_ms, write=False):
                    return None
                if not replica.token:
                    errors.append(f"{replica.node_id}: shared memory unusable and no token")
                    continue
                self._transfer.read((replica.data_host, replica.data_port), replica.token,
                                    [(replica.offset, replica.size)], view)
                return None
            except (TransferError, OSError, ValueError) as e:
                errors.append(f"{replica.node_id}: {e}")
        return "; ".join(errors) or "no replicas"

    def read_mapped(self, hits: list[Hit], views: list[memoryview], out: list[int | None]) -> list[Hit]:
        """Fast path of a batch get: copy every hit whose first replica is a segment we have
        mapped already (the per-key Python work is a large part of a small-object get); sets
        out[index] = size for those. Returns the hits left for `read`."""
        rest = []
        read_maps, host_id = self._read_maps, self.host_id
        for hit in hits:
            index, result, size = hit
            replica = result.replicas[0] if len(result.replicas) else None
            src = read_maps.get((replica.shm_name, replica.segment_size)) if replica is not None else None
            if src is None or replica.host_id != host_id or now_ms() > result.lease_expiry_ms:
                rest.append(hit)
                continue
            offset = replica.offset
            views[index][:size] = src[offset:offset + size]  # one memcpy
            out[index] = size
        return rest


__all__ = ["Hit", "ReplicaIO"]
