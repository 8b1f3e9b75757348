"""StoreWorker: one rank's half of the store connector. Moves bytes; decides nothing.

    step:   start(meta)          queue the loads, open this step's save batch (staging slots)
            save_layer(l, kv)    after layer l's attention: pack layer l of the batch's blocks
            wait_for_save()      every layer packed -> hand the batch to the save thread; from here
                                 the cache blocks may be reused, the bytes live in staging
            get_finished()       (finished_sending, finished_recving) for this rank

    A step whose saves do not fit in free staging at start (a long prefill) is packed after the
    forward instead, chunk by chunk, waiting up to save_wait_s for the save thread to free room:
    the forward never waits, the step's end may, and a prefill leg's blocks are not lost.

    save thread   batch_put_from(keys, slots), free the slots, count the request's saves down
    load thread   per chunk: batch_get_into(keys, slots) -> unpack the good prefix into the cache;
                  blocks from the first failure on are reported failed (they were not written)

Saves are packed inside the forward pass, so later steps (or another request after a preemption)
may overwrite the blocks at once. Loads run across steps (the scheduler keeps the request in
WAITING_FOR_REMOTE_KV) and write only blocks the loading request owns: nothing else reads them.
A rank writes only the shards it owns (a replicated head: only its first holder) and reads every
shard covering its heads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdcluster.engine.kv_connector import KVCacheLayout

from ..p2p.load_times import LoadTimes
from .backend import PutResult, StoreBackend, StoreBackendError
from .backend_factory import make_backend
from .block_io import pack_all, pack_layer, shard_objects, unpack_blocks
from .meta import BlockSpec, StoreConnectorMetadata
from .options import StoreOptions
from .staging import StagingRing

log = logging.getLogger(__name__)
_STOP = object()


@dataclass
class _SaveBatch:
    block_ids: list[int]
    hashes: list[bytes]
    owners: list[str]  # request of each block
    start: int = -1  # first staging slot (-1: not staged yet); shard j's objects: [start + j*n, start + (j+1)*n)
    layers_done: int = 0

    @property
    def request_ids(self) -> list[str]:  # each counts one outstanding save until the batch is written
        return sorted(set(self.owners))

    def part(self, a: int, b: int) -> _SaveBatch:
        return _SaveBatch(self.block_ids[a:b], self.hashes[a:b], self.owners[a:b])


class StoreWorker:
    def __init__(self, opts: StoreOptions, backend: StoreBackend | None = None) -> None:
        self.opts = opts
        self.layout = opts.layout
        self._backend = backend
        self._kv: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._outstanding: Counter[str] = Counter()  # request -> save batches not yet written
        self._finish_pending: set[str] = set()
        self._done_recving: set[str] = set()
        self.wake: Callable[[], None] = lambda: None  # the engine's wake-up (set_wakeup); never blocks
        self._cancelled: set[str] = set()
        self._loading: set[str] = set()  # queued or running loads (cancels of others are stale)
        self._failed: set[int] = set()
        self._batch: _SaveBatch | None = None
        self._saves: queue.Queue[Any] = queue.Queue()
        self._loads: queue.Queue[Any] = queue.Queue()
        self._threads: list[threading.Thread] = []
        # Every key up front: stats() copies this dict while the I/O threads update it, which is
        # safe only as long as no thread adds a key.
        self.counters: Counter[str] = Counter(dict.fromkeys((
            "save_dropped_blocks", "save_failed_blocks", "put_stored", "put_exists", "put_failed", "save_bytes",
            "load_blocks", "load_bytes", "load_failed_blocks", "load_cancelled"), 0))
        self.load_seconds = LoadTimes()  # loads whose every block landed: the load thread's read + unpack (_lock)

    # -- setup -----------------------------------------------------------------------------------
    def register(self, kv_caches: Any, cache_layout: KVCacheLayout) -> None:
        self._kv = kv_caches  # (L, 2, nb, N, H_local, C): the runner's one tensor
        self._dtype = kv_caches.dtype
        slices = self.layout.rank_shards(cache_layout.tp_rank, cache_layout.tp_size)
        self._read = slices
        self._write = [s for s in slices if s.writes] if self.opts.save else []
        slot = self.layout.object_nbytes
        mib = 1 << 20
        self._save_ring = StagingRing(slot, max(len(slices), self.opts.save_staging_mib * mib // slot))
        self._load_ring = StagingRing(slot, max(len(slices), self.opts.load_staging_mib * mib // slot))
        if self._backend is None:
            self._backend = make_backend(self.opts.backend, self.opts.backend_options)
        self._backend.register_buffer(self._save_ring.buffer)
        self._backend.register_buffer(self._load_ring.buffer)
        for name, target in (("save", self._save_loop), ("load", self._load_loop)):
            t = threading.Thread(target=target, name=f"store-{name}-r{cache_layout.tp_rank}", daemon=True)
            t.start()
            self._threads.append(t)

    # -- one step (forward thread) ---------------------------------------------------------------
    def start(self, meta: StoreConnectorMetadata | None) -> None:
        if self._batch is not None:  # last step opened a batch but ran no forward: drop it
            self._drop_batch("no forward pass")
        if meta is None:
            return
        with self._lock:
            self._loading.update(s.request_id for s in meta.loads)
            self._cancelled.update(r for r in meta.cancels if r in self._loading)
            self._finish_pending.update(meta.finished)
        for spec in meta.loads:
            self._loads.put(spec)
        if meta.saves and self._write:
            self._open_batch(meta.saves)

    def _open_batch(self, specs: list[BlockSpec]) -> None:
        b = _SaveBatch([x for sp in specs for x in sp.block_ids], [h for sp in specs for h in sp.block_hashes],
                       [sp.request_id for sp in specs for _ in sp.block_ids])
        start = self._save_ring.alloc(len(b.block_ids) * len(self._write), timeout_s=0.0)  # never stall the forward
        if start is not None:
            b.start = start
            with self._lock:
                self._outstanding.update(b.request_ids)
        self._batch = b  # unstaged: packed after the forward (wait_for_save)

    def _objects(self, ring: StagingRing, start: int, n: int, j: int) -> torch.Tensor:
        return shard_objects(ring.slots(start + j * n, n), self.layout, self._dtype)

    def save_layer(self, layer: int, kv_layer: Any) -> None:
        b = self._batch
        if b is None or b.start < 0 or b.layers_done != layer:
            return
        n = len(b.block_ids)
        for j, s in enumerate(self._write):
            pack_layer(kv_layer, layer, b.block_ids, self._objects(self._save_ring, b.start, n, j), self.layout,
                       s.local_h0, s.local_h1)
        b.layers_done += 1

    def wait_for_save(self) -> None:
        b, self._batch = self._batch, None
        if b is None:
            return
        if b.start < 0:
            self._stage_in_chunks(b)
            return
        if b.layers_done < self.layout.num_layers:  # not called per layer: pack everything now
            self._pack(b)
        self._saves.put(b)

    def _pack(self, b: _SaveBatch) -> None:
        n = len(b.block_ids)
        for j, s in enumerate(self._write):
            pack_all(self._kv, b.block_ids, self._objects(self._save_ring, b.start, n, j), self.layout,
                     s.local_h0, s.local_h1)

    def _stage_in_chunks(self, b: _SaveBatch) -> None:
        """The step's saves did not fit at its start: pack them now, as much staging as frees up."""
        k = len(self._write)
        chunk = max(1, self._save_ring.num_slots // k)
        for a in range(0, len(b.block_ids), chunk):
            part = b.part(a, a + chunk)
            start = self._save_ring.alloc(len(part.block_ids) * k, timeout_s=self.opts.save_wait_s)
            if start is None:
                self.counters["save_dropped_blocks"] += len(b.block_ids) - a
                log.warning("store connector: staging still full after %.1fs, not saving %d block(s) "
                            "(save_staging_mib=%d)", self.opts.save_wait_s, len(b.block_ids) - a,
                            self.opts.save_staging_mib)
                return
            part.start = start
            with self._lock:
                self._outstanding.update(part.request_ids)
            self._pack(part)
            self._saves.put(part)

    def _drop_batch(self, why: str) -> None:
        b, self._batch = self._batch, None
        assert b is not None
        self.counters["save_dropped_blocks"] += len(b.block_ids)
        log.warning("store connector: dropping %d block save(s): %s", len(b.block_ids), why)
        if b.start >= 0:
            self._save_ring.free(b.start)
            self._save_done(b.request_ids)

    # -- background ------------------------------------------------------------------------------
    def _save_loop(self) -> None:
        while (b := self._saves.get()) is not _STOP:
            try:
                self._put(b)
            except Exception:  # a bug or a dead store must not kill the thread: count, go on
                log.exception("store connector: save failed")
                self.counters["save_failed_blocks"] += len(b.block_ids)
            finally:
                self._save_ring.free(b.start)
                self._save_done(b.request_ids)

    def _put(self, b: _SaveBatch) -> None:
        n = len(b.block_ids)
        keys: list[str] = []
        bufs: list[torch.Tensor] = []
        for j, s in enumerate(self._write):
            slots = self._save_ring.slots(b.start + j * n, n)
            keys.extend(self.layout.key(s.shard, h) for h in b.hashes)
            bufs.extend(slots.unbind(0))
        try:
            results = self._backend.batch_put_from(keys, bufs)
        except StoreBackendError as e:
            log.warning("store connector: put of %d object(s) failed: %s", len(keys), e)
            results = [PutResult.FAILED] * len(keys)
        for r in results:
            self.counters[f"put_{r.name.lower()}"] += 1
        self.counters["save_bytes"] += sum(self.layout.object_nbytes for r in results if r == PutResult.STORED)

    def _save_done(self, request_ids: list[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._outstanding[request_id] -= 1
                if self._outstanding[request_id] <= 0:
                    del self._outstanding[request_id]
        self.wake()

    def _load_loop(self) -> None:
        while (spec := self._loads.get()) is not _STOP:
            started = time.monotonic()
            try:
                if self._load(spec):
                    with self._lock:
                        self.load_seconds.observe(time.monotonic() - started)
            except Exception:
                log.exception("store connector: load of %s failed", spec.request_id)
                with self._lock:
                    self._failed.update(spec.block_ids)
            with self._lock:
                self._done_recving.add(spec.request_id)
                self._cancelled.discard(spec.request_id)
                self._loading.discard(spec.request_id)
            self.wake()

    def _load(self, spec: BlockSpec) -> bool:
        """True when every block of the request landed in the cache."""
        k = len(self._read)
        chunk = max(1, self._load_ring.num_slots // k)
        for a in range(0, len(spec.block_ids), chunk):
            with self._lock:
                cancelled = spec.request_id in self._cancelled
            if cancelled:  # its blocks are freed unpublished once we report it: nothing to flag
                self.counters["load_cancelled"] += 1
                return False
            ids, hashes = spec.block_ids[a:a + chunk], spec.block_hashes[a:a + chunk]
            good = self._load_chunk(ids, hashes)
            if good < len(ids):  # the rest of the request's blocks hold nothing valid
                with self._lock:
                    self._failed.update(spec.block_ids[a + good:])
                self.counters["load_failed_blocks"] += len(spec.block_ids) - a - good
                return False
        return True

    def _load_chunk(self, ids: list[int], hashes: list[bytes]) -> int:
        """Read and unpack one chunk; returns how many leading blocks landed in the cache."""
        n, k = len(ids), len(self._read)
        start = self._load_ring.alloc(n * k, timeout_s=None)
        if start is None:
            return 0
        try:
            keys = [self.layout.key(s.shard, h) for s in self._read for h in hashes]
            bufs = [row for j in range(k) for row in self._load_ring.slots(start + j * n, n).unbind(0)]
            try:
                ok = self._backend.batch_get_into(keys, bufs)
            except StoreBackendError as e:
                log.warning("store connector: get of %d object(s) failed: %s", len(keys), e)
                return 0
            good = next((i for i in range(n) if not all(ok[j * n + i] for j in range(k))), n)
            for j, s in enumerate(self._read):
                objs = self._objects(self._load_ring, start, n, j)[:good]
                unpack_blocks(objs, self._kv, ids[:good], self.layout, s.local_h0, s.local_h1)
            self.counters["load_blocks"] += good
            self.counters["load_bytes"] += good * k * self.layout.object_nbytes
            return good
        finally:
            self._load_ring.free(start)

    # -- reports ---------------------------------------------------------------------------------
    def get_finished(self) -> tuple[set[str], set[str]]:
        with self._lock:
            sending = {r for r in self._finish_pending if self._outstanding.get(r, 0) == 0}
            self._finish_pending -= sending
            recving, self._done_recving = self._done_recving, set()
        return sending, recving

    def get_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"store_{k}": v for k, v in self.counters.items()}
        with self._lock:
            out["store_load_seconds"] = self.load_seconds.snapshot()  # -> the transfer-time histogram
        return out

    def shutdown(self) -> None:
        for q in (self._saves, self._loads):
            q.put(_STOP)
        for ring in (getattr(self, "_save_ring", None), getattr(self, "_load_ring", None)):
            if ring is not None:
                ring.close()
        for t in self._threads:
            t.join(timeout=30)
        self._threads.clear()
        if self._backend is not None:
            self._backend.close()
            self._backend = None


__all__ = ["StoreWorker"]
