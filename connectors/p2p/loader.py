"""Loader: the consumer half of one worker rank. Pulls leased blocks from producers into this
rank's cache, in background threads, and reports each request once when its load ended.

One load (request R, local blocks D, producer blocks S = lease[first_block:]):

    resolve producer (registry / signed params) -> handshake (cached; epoch must match params)
    -> open(R, transfer, lease, first_block): S and READ tokens (retried briefly while the
       lease is not registered yet: the producer registers it one engine step after finishing)
    -> heartbeats renew the lease while we work
    -> copy: memcpy from the producer's shared-memory cache (same host) or scatter READ over TCP,
       each window checked against its MAC (key from the open reply) as it lands
    -> done(ok): "released" proves the lease outlived every read; anything else = bad data
    -> R in finished_recving; on any failure D in failed blocks too (the scheduler applies the
       failure policy), and the producer is told so it frees early.

Tensor parallelism (tp_plan.py): the params name every producer rank (endpoint, epoch); this
consumer rank reads, rank by rank, the head slices its plan assigns (a full-rank slice is the
plain block copy above; a partial one is read whole-block into a staging buffer, or mapped over
shared memory, and its heads copied out), then says "done" to every producer rank it owes a
notice, carrying (consumer_rank, consumer_tp) so each producer rank counts its expected notices.

Every wait has a deadline (request_timeout_s, io_timeout_s, open_retry_s). Cancellation (the
request finished while loading) stops at the next phase boundary; an in-flight read finishes or
times out first, so nothing writes into D after R is reported.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pdcluster.dtypes import torch_dtype
from pdcluster.engine.kv_connector import KVCacheLayout, KVTransferParams
from pdcluster.handoff_trace import trace
from pdcluster.transfer import SharedRegionCache, TransferError, local_host_id

from .blocks import CacheGeometry, block_ranges, chunk_block_ids, copy_blocks
from .heartbeat import Heartbeats
from .load_times import LoadTimes
from .options import P2POptions, check_endpoint
from .params import producer_ranks
from .peer import ChannelPool, Handshake, HandshakeCache, LoadError, Producer, call, resolve_producer
from .scatter_reader import ScatterReader
from .tp_plan import head_range, notify_ranks, read_plan
from .wire import DONE, OPEN

log = logging.getLogger(__name__)

_OPEN_RETRY_FIRST_S = 0.001  # first pause after "lease unknown"; doubles up to the max
_OPEN_RETRY_MAX_S = 0.02


@dataclass
class LoadJob:
    request_id: str
    local_block_ids: list[int]
    first_block: int
    params: KVTransferParams
    cancelled: threading.Event
    notified: set[int] = field(default_factory=set)  # producer ranks told "done" already
    targets: dict[int, Producer] = field(default_factory=dict)  # producer ranks owed a "done"


class Loader:
    def __init__(self, opts: P2POptions, fingerprint: dict[str, Any], geo: CacheGeometry, cache: memoryview,
                 layout: KVCacheLayout | None = None) -> None:
        self.opts, self.geo, self.cache = opts, geo, cache
        self.layout = layout or KVCacheLayout(geo.num_layers, geo.num_blocks, 1, 1, geo.block_nbytes // 4, "float32")
        self.pool = ChannelPool(opts)
        self.handshakes = HandshakeCache(self.pool, opts, fingerprint)
        self.reader = ScatterReader(opts.num_streams, opts.min_stream_bytes, opts.connect_timeout_s, opts.io_timeout_s)
        self.shm = SharedRegionCache()
        self.heartbeats = Heartbeats(self.pool)
        self._host_id = local_host_id()
        self._executor = ThreadPoolExecutor(max_workers=opts.num_load_threads, thread_name_prefix="p2p-load")
        self._lock = threading.Lock()
        self._closing = threading.Event()  # ends a release's retries at once
        self._jobs: dict[str, LoadJob] = {}
        self._finished: set[str] = set()
        self._failed: set[int] = set()
        self.counters = {"loads_ok": 0, "loads_failed": 0, "bytes_tcp": 0, "bytes_shm": 0, "failed_blocks": 0,
                         "open_retries": 0, "release_retries": 0}
        self.load_seconds = LoadTimes()  # successful pulls, handshake to the producer's "released"
        self.last_errors: dict[str, str] = {}  # request id -> why its load failed (bounded)
        self.on_finished: Callable[[], None] = lambda: None  # the engine's wake-up (set_wakeup); never blocks

    # -- engine thread ---------------------------------------------------------------------------
    def submit(self, request_id: str, local_block_ids: list[int], first_block: int, params: KVTransferParams) -> None:
        job = LoadJob(request_id, local_block_ids, first_block, params, threading.Event())
        with self._lock:
            self._jobs[request_id] = job
        self._executor.submit(self._run, job)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            job = self._jobs.get(request_id)
        if job is not None:
            job.cancelled.set()

    def release(self, request_id: str, params: KVTransferParams) -> None:
        """Tell the producer we will not read (e.g. everything was a local prefix hit)."""
        self._executor.submit(self._release, request_id, params)

    def take_finished(self) -> set[str]:
        with self._lock:
            out, self._finished = self._finished, set()
            return out

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            out, self._failed = self._failed, set()
            return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {f"p2p_{k}": v for k, v in self.counters.items()} | {"p2p_loads_in_flight": len(self._jobs),
                                                                       "p2p_load_seconds": self.load_seconds.snapshot()}

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.cancelled.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.heartbeats.close()
        self.reader.close()
        self.shm.close()
        self.pool.close()

    # -- load threads ----------------------------------------------------------------------------
    def _run(self, job: LoadJob) -> None:
        error: str | None = None
        producer: Producer | None = None
        started = time.monotonic()
        trace("d.load_start", job.request_id)
        try:
            producer = resolve_producer(job.params, self.opts)
            self._load(job, producer)
        except (LoadError, TransferError, OSError, ValueError) as e:
            error = str(e)
        except Exception as e:  # a bug fails this load, never the engine
            log.exception("p2p load of %s crashed", job.request_id)
            error = f"internal error: {type(e).__name__}: {e}"
        if error is not None:
            log.warning("p2p load of request %s failed: %s", job.request_id, error)
            if producer is not None:
                self._notify_all(producer, job, ok=False)
        with self._lock:
            del self._jobs[job.request_id]
            self._finished.add(job.request_id)
            if error is None:
                self.counters["loads_ok"] += 1
                self.load_seconds.observe(time.monotonic() - started)
            else:
                self.counters["loads_failed"] += 1
                self.counters["failed_blocks"] += len(job.local_block_ids)
                self._failed.update(job.local_block_ids)
                self.last_errors[job.request_id] = error
                while len(self.last_errors) > 256:
                    self.last_errors.pop(next(iter(self.last_errors)))
        self.on_finished()

    def _targets(self, job: LoadJob, producer: Producer) -> tuple[dict[int, Producer], dict[int, int], int]:
        """(producer rank -> Producer for every rank this rank may talk to, rank -> epoch, P)."""
        ranks = producer_ranks(job.params)
        out, epochs = {}, {}
        for r, (endpoint, epoch) in enumerate(ranks):
            if r == 0:
                out[r] = producer  # rank 0's endpoint: the registry's or the signed params'
            else:
                out[r] = Producer(producer.producer_id, check_endpoint(endpoint), producer.public_key)
            epochs[r] = epoch
        return out, epochs, len(ranks)

    def _load(self, job: LoadJob, producer: Producer) -> None:
        lay = self.layout
        prods, epochs, ptp = self._targets(job, producer)
        total_heads, ctp, crank = lay.total_heads, lay.tp_size, lay.tp_rank
        try:
            pieces = read_plan(total_heads, ptp, ctp, crank)
        except ValueError as e:
            raise LoadError(f"producer {producer.producer_id!r}: {e}") from e
        job.targets = {r: prods[r] for r in notify_ranks(total_heads, ptp, ctp, crank)}
        read_ranks = sorted({pc.producer_rank for pc in pieces})
        for r in read_ranks:
            if job.cancelled.is_set():
                raise LoadError("cancelled")
            self._load_rank(job, prods[r], r, epochs[r], ptp, [pc for pc in pieces if pc.producer_rank == r])
        for r in sorted(job.targets):
            status = self._notify_done(job.targets[r], job, ok=True, rank=r)
            trace("d.done", job.request_id)
            if r in read_ranks and status != "released":
                raise LoadError(f"lease {status} on producer rank {r} before the transfer was confirmed: "
                                "the data cannot be trusted")

    def _load_rank(self, job: LoadJob, producer: Producer, rank: int, epoch: int, ptp: int,
                   pieces: list[Any]) -> None:
        p = job.params
        lay = self.layout
        hs = self.handshakes.get(producer, epoch)
        if hs.epoch != epoch:
            raise LoadError(f"producer {producer.producer_id!r} rank {rank} restarted (epoch {hs.epoch}, params "
                            f"from epoch {epoch}): its blocks are gone")
        trace("d.handshake", job.request_id)
        body = hs.body
        h0, h1 = head_range(lay.total_heads, ptp, rank)
        src_heads = h1 - h0
        want = lay.block_size * src_heads * lay.head_dim * lay.itemsize
        if body["tp_size"] != ptp or body["tp_rank"] != rank or body["block_nbytes"] != want:
            raise LoadError(f"producer {producer.producer_id!r} at {producer.endpoint} is rank {body['tp_rank']} of "
                            f"{body['tp_size']} with block_nbytes={body['block_nbytes']}; expected rank {rank} of "
                            f"{ptp} with {want}")
        reply = self._open(job, hs)
        trace("d.open", job.request_id)
        src_ids = reply["block_ids"]
        if len(src_ids) != len(job.local_block_ids):
            raise LoadError(f"producer leased {len(src_ids)} blocks from block {job.first_block}, "
                            f"this request needs {len(job.local_block_ids)}")
        self.heartbeats.add(producer, p.lease_id, p.transfer_id, reply.get("ttl_ms") or 0)
        try:
            if self.opts.debug_pause_before_read_s and job.cancelled.wait(self.opts.debug_pause_before_read_s):
                raise LoadError("cancelled")
            if job.cancelled.is_set():
                raise LoadError("cancelled")
            full = (len(pieces) == 1 and pieces[0].src_h0 == 0 and pieces[0].src_h1 == src_heads
                    and pieces[0].dst_h0 == 0 and pieces[0].dst_h1 == lay.num_kv_heads)
            if full:
                self._copy(job, hs, src_ids, self._grants(reply))
            else:
                self._copy_heads(job, hs, src_ids, self._grants(reply), src_heads, pieces)
            trace("d.copied", job.request_id)
        finally:
            self.heartbeats.remove(p.lease_id)

    def _cache_tensor(self) -> torch.Tensor:
        lay = self.layout
        t = torch.frombuffer(self.cache, dtype=torch_dtype(lay.dtype))
        return t.view(lay.num_layers, *lay.layer_shape)

    def _grants(self, reply: dict[str, Any]) -> list[tuple[bytes, bytes | None]]:
        """(token, payload MAC key or None when data_mac is off) per chunk of the open reply."""
        tokens = reply.get("tokens") or []
        if not self.opts.data_mac:
            return [(token, None) for token in tokens]
        mac_keys = reply.get("mac_keys") or []
        if len(mac_keys) != len(tokens):
            raise LoadError(f"producer sent {len(mac_keys)} payload MAC keys for {len(tokens)} tokens")
        return list(zip(tokens, mac_keys))

    def _copy_heads(self, job: LoadJob, hs: Handshake, src_ids: list[int], tokens: list[tuple[bytes, bytes | None]],
                    src_heads: int,
                    pieces: list[Any]) -> None:
        """Heterogeneous TP: copy head slices of the producer rank's blocks into ours."""
        lay, body = self.layout, hs.body
        dtype = torch_dtype(lay.dtype)
        src_geo = CacheGeometry(self.geo.num_layers, body["num_blocks"], body["block_nbytes"])
        dst = self._cache_tensor()
        dst_idx = torch.tensor(job.local_block_ids, dtype=torch.long)
        same_host = self.opts.transport != "tcp" and body.get("shm_name") and body["host_id"] == self._host_id
        if same_host:
            try:
                region = self.shm.get(body["shm_name"], body["region_nbytes"], writable=False)
            except (OSError, ValueError) as e:
                raise LoadError(f"cannot map the producer's shared memory: {e}") from e
            with warnings.catch_warnings():  # read-only mapping, only ever read: torch's warning is moot
                warnings.simplefilter("ignore", UserWarning)
                src_flat = torch.frombuffer(region.view, dtype=dtype)
            src_all = src_flat.view(
                lay.num_layers, 2, body["num_blocks"], lay.block_size, src_heads, lay.head_dim)
            src = src_all[:, :, torch.tensor(src_ids, dtype=torch.long)]
            self._add("bytes_shm", src.numel() * lay.itemsize)
        elif self.opts.transport == "shm":
            raise LoadError("transport 'shm' requested but the producer is not on this host or has no shared cache")
        else:
            # Staging: whole blocks of the producer rank, in transfer order (layer, k|v, block).
            src_chunks = chunk_block_ids(src_ids, self.geo.num_layers)
            if len(tokens) != len(src_chunks):
                raise LoadError(f"producer sent {len(tokens)} tokens for {len(src_chunks)} chunks")
            parts = []
            addr = (body["data_host"], body["data_port"])
            for (token, mac_key), chunk in zip(tokens, src_chunks):
                ranges = block_ranges(src_geo, chunk)
                nbytes = sum(n for _, n in ranges)
                staging = bytearray(nbytes)
                n = self.reader.read(addr, token, ranges, memoryview(staging), [(0, nbytes)], mac_key)
                self._add("bytes_tcp", n)
                parts.append(torch.frombuffer(staging, dtype=dtype).view(
                    lay.num_layers, 2, len(chunk), lay.block_size, src_heads, lay.head_dim))
            src = torch.cat(parts, dim=2)
        for pc in pieces:
            dst[:, :, dst_idx, :, pc.dst_h0:pc.dst_h1] = src[:, :, :, :, pc.src_h0:pc.src_h1]

    def _open(self, job: LoadJob, hs: Handshake) -> dict[str, Any]:
        p = job.params
        deadline = time.monotonic() + self.opts.open_retry_s
        pause = _OPEN_RETRY_FIRST_S
        while True:
            reply = call(self.pool, hs.producer, OPEN, {"request_id": job.request_id, "transfer_id": p.transfer_id,
                                                        "lease_id": p.lease_id, "first_block": job.first_block})
            if reply["epoch"] != hs.epoch:
                raise LoadError(f"producer {hs.producer.producer_id!r} restarted during the transfer")
            if reply["ok"]:
                return reply
            # The producer registers a lease one engine step after the params left it: "unknown"
            # right away is not final.
            if "lease unknown" not in (reply.get("error") or "") or time.monotonic() > deadline:
                raise LoadError(f"producer {hs.producer.producer_id!r} refused to open the transfer: {reply.get('error')}")
            self._add("open_retries", 1)  # NOT_READY: counted, so a producer that is slow to register shows
            # Back off from 1 ms: the lease usually lands within a step, and a fixed 20 ms pause
            # put the whole wait on the hand-off (measured: 2 of 11 pulls paid it at 256 tokens).
            if job.cancelled.wait(pause):
                raise LoadError("cancelled")
            pause = min(pause * 2, _OPEN_RETRY_MAX_S)

    def _copy(self, job: LoadJob, hs: Handshake, src_ids: list[int], tokens: list[tuple[bytes, bytes | None]]) -> None:
        body = hs.body
        src_geo = CacheGeometry(self.geo.num_layers, body["num_blocks"], body["block_nbytes"])
        if self.opts.transport != "tcp" and body.get("shm_name") and body["host_id"] == self._host_id:
            try:
                region = self.shm.get(body["shm_name"], body["region_nbytes"], writable=False)
            except (OSError, ValueError) as e:
                if self.opts.transport == "shm":
                    raise LoadError(f"cannot map the producer's shared memory: {e}") from e
            else:
                n = copy_blocks(src_geo, region.view, self.geo, self.cache, src_ids, job.local_block_ids)
                self._add("bytes_shm", n)
                return
        elif self.opts.transport == "shm":
            raise LoadError("transport 'shm' requested but the producer is not on this host or has no shared cache")
        addr = (body["data_host"], body["data_port"])
        src_chunks = chunk_block_ids(src_ids, self.geo.num_layers)
        dst_chunks = chunk_block_ids(job.local_block_ids, self.geo.num_layers)
        if len(tokens) != len(src_chunks):
            raise LoadError(f"producer sent {len(tokens)} tokens for {len(src_chunks)} chunks")
        for (token, mac_key), src, dst in zip(tokens, src_chunks, dst_chunks):
            n = self.reader.read(addr, token, block_ranges(src_geo, src), self.cache, block_ranges(self.geo, dst),
                                 mac_key)
            self._add("bytes_tcp", n)

    def _notify_all(self, producer: Producer, job: LoadJob, ok: bool) -> dict[int, str]:
        """Tell every producer rank we owe a notice and have not told yet (best effort); returns
        each told rank's answer (_notify_done's)."""
        targets = job.targets
        if not targets:
            try:
                prods, _, ptp = self._targets(job, producer)
                lay = self.layout
                targets = {r: prods[r] for r in notify_ranks(lay.total_heads, ptp, lay.tp_size, lay.tp_rank)}
            except (ValueError, LoadError):
                targets = {0: producer}
        return {r: self._notify_done(targets[r], job, ok, rank=r) for r in sorted(targets) if r not in job.notified}

    def _notify_done(self, producer: Producer, job: LoadJob, ok: bool, rank: int = 0) -> str:
        p = job.params
        job.notified.add(rank)
        try:
            reply = call(self.pool, producer, DONE, {"request_id": job.request_id, "transfer_id": p.transfer_id,
                                                     "lease_id": p.lease_id, "ok": ok,
                                                     "consumer_rank": self.layout.tp_rank,
                                                     "consumer_tp": self.layout.tp_size})
        except LoadError as e:
            log.info("p2p done notice for %s not delivered: %s", job.request_id, e)
            return "unreachable"
        return reply.get("status") or ("released" if reply["ok"] else "refused")

    def _release(self, request_id: str, params: KVTransferParams) -> None:
        """A leg that never read (refused, cancelled, all local hits) lets the producer go now.
        The producer registers its lease one engine step after the params left it, so a release
        can beat the lease there: "unknown" is retried, as OPEN's is, up to open_retry_s (else the
        blocks would stay held to lease expiry). Any other answer is final."""
        job = LoadJob(request_id, [], 0, params, threading.Event())
        deadline = time.monotonic() + self.opts.open_retry_s
        pause = _OPEN_RETRY_FIRST_S
        try:
            producer = resolve_producer(params, self.opts)
            while True:
                unknown = [r for r, status in self._notify_all(producer, job, ok=False).items() if status == "unknown"]
                if not unknown or time.monotonic() > deadline or self._closing.wait(pause):
                    return
                job.notified.difference_update(unknown)  # only the ranks that did not know it yet
                self._add("release_retries", 1)
                pause = min(pause * 2, _OPEN_RETRY_MAX_S)
        except LoadError as e:
            log.info("p2p release of %s: %s", request_id, e)

    def _add(self, name: str, n: int) -> None:
        with self._lock:
            self.counters[name] += n
