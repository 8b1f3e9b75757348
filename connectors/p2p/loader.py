"""Loader: the consumer half of one worker rank. Pulls leased blocks from producers into this
rank's cache, in background threads, and reports each request once when its load ended.

One load (request R, local blocks D, producer blocks S = lease[first_block:]):

    resolve producer (registry / signed params) -> handshake (cached; epoch must match params)
    -> open(R, transfer, lease, first_block): S and READ tokens (retried briefly while the
       lease is not registered yet: the producer registers it one engine step after finishing)
    -> heartbeats renew the lease while we work
    -> copy: memcpy from the producer's shared-memory cache (same host) or scatter READ over TCP
    -> done(ok): "released" proves the lease outlived every read; anything else = bad data
    -> R in finished_recving; on any failure D in failed blocks too (the scheduler applies the
       failure policy), and the producer is told so it frees early.

Every wait has a deadline (request_timeout_s, io_timeout_s, open_retry_s). Cancellation (the
request finished while loading) stops at the next phase boundary; an in-flight read finishes or
times out first, so nothing writes into D after R is reported.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdcluster.transfer import SharedRegionCache, TransferError, local_host_id

from .blocks import CacheGeometry, block_ranges, chunk_block_ids, copy_blocks
from .heartbeat import Heartbeats
from .options import P2POptions
from .peer import ChannelPool, Handshake, HandshakeCache, LoadError, Producer, call, resolve_producer
from .scatter_reader import ScatterReader
from .wire import DONE, OPEN

log = logging.getLogger(__name__)


@dataclass
class LoadJob:
    request_id: str
    local_block_ids: list[int]
    first_block: int
    params: dict[str, Any]
    cancelled: threading.Event


class Loader:
    def __init__(self, opts: P2POptions, fingerprint: dict[str, Any], geo: CacheGeometry, cache: memoryview) -> None:
        self.opts, self.geo, self.cache = opts, geo, cache
        self.pool = ChannelPool(opts)
        self.handshakes = HandshakeCache(self.pool, opts, fingerprint)
        self.reader = ScatterReader(opts.num_streams, opts.min_stream_bytes, opts.connect_timeout_s, opts.io_timeout_s)
        self.shm = SharedRegionCache()
        self.heartbeats = Heartbeats(self.pool)
        self._host_id = local_host_id()
        self._executor = ThreadPoolExecutor(max_workers=opts.num_load_threads, thread_name_prefix="p2p-load")
        self._lock = threading.Lock()
        self._jobs: dict[str, LoadJob] = {}
        self._finished: set[str] = set()
        self._failed: set[int] = set()
        self.counters = {"loads_ok": 0, "loads_failed": 0, "bytes_tcp": 0, "bytes_shm": 0}
        self.last_errors: dict[str, str] = {}  # request id -> why its load failed (bounded)

    # -- engine thread ---------------------------------------------------------------------------
    def submit(self, request_id: str, local_block_ids: list[int], first_block: int, params: dict[str, Any]) -> None:
        job = LoadJob(request_id, local_block_ids, first_block, params, threading.Event())
        with self._lock:
            self._jobs[request_id] = job
        self._executor.submit(self._run, job)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            job = self._jobs.get(request_id)
        if job is not None:
            job.cancelled.set()

    def release(self, request_id: str, params: dict[str, Any]) -> None:
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
            return {f"p2p_{k}": v for k, v in self.counters.items()} | {"p2p_loads_in_flight": len(self._jobs)}

    def close(self) -> None:
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
                self._notify_done(producer, job, ok=False)
        with self._lock:
            del self._jobs[job.request_id]
            self._finished.add(job.request_id)
            if error is None:
                self.counters["loads_ok"] += 1
            else:
                self.counters["loads_failed"] += 1
                self._failed.update(job.local_block_ids)
                self.last_errors[job.request_id] = error
                while len(self.last_errors) > 256:
                    self.last_errors.pop(next(iter(self.last_errors)))

    def _load(self, job: LoadJob, producer: Producer) -> None:
        p = job.params
        hs = self.handshakes.get(producer, p["engine_epoch"])
        if hs.epoch != p["engine_epoch"]:
            raise LoadError(f"producer {producer.producer_id!r} restarted (epoch {hs.epoch}, params from "
                            f"epoch {p['engine_epoch']}): its blocks are gone")
        body = hs.body
        if body["block_nbytes"] != self.geo.block_nbytes or body["tp_size"] != 1:
            raise LoadError(f"producer {producer.producer_id!r} has block_nbytes={body['block_nbytes']} "
                            f"tp_size={body['tp_size']}; this consumer needs {self.geo.block_nbytes} and tp 1")
        reply = self._open(job, hs)
        src_ids = reply["block_ids"]
        if len(src_ids) != len(job.local_block_ids):
            raise LoadError(f"producer leased {len(src_ids)} blocks from block {job.first_block}, "
                            f"this request needs {len(job.local_block_ids)}")
        self.heartbeats.add(producer, p["lease_id"], p["transfer_id"], reply.get("ttl_ms") or 0)
        try:
            if self.opts.debug_pause_before_read_s and job.cancelled.wait(self.opts.debug_pause_before_read_s):
                raise LoadError("cancelled")
            if job.cancelled.is_set():
                raise LoadError("cancelled")
            self._copy(job, hs, src_ids, reply["tokens"])
        finally:
            self.heartbeats.remove(p["lease_id"])
        status = self._notify_done(producer, job, ok=True)
        if status != "released":
            raise LoadError(f"lease {status} before the transfer was confirmed: the data cannot be trusted")

    def _open(self, job: LoadJob, hs: Handshake) -> dict[str, Any]:
        p = job.params
        deadline = time.monotonic() + self.opts.open_retry_s
        while True:
            reply = call(self.pool, hs.producer, OPEN, {"request_id": job.request_id, "transfer_id": p["transfer_id"],
                                                        "lease_id": p["lease_id"], "first_block": job.first_block})
            if reply["epoch"] != hs.epoch:
                raise LoadError(f"producer {hs.producer.producer_id!r} restarted during the transfer")
            if reply["ok"]:
                return reply
            # The producer registers a lease one engine step after the params left it: "unknown"
            # right away is not final.
            if "lease unknown" not in (reply.get("error") or "") or time.monotonic() > deadline:
                raise LoadError(f"producer {hs.producer.producer_id!r} refused to open the transfer: {reply.get('error')}")
            if job.cancelled.wait(0.02):
                raise LoadError("cancelled")

    def _copy(self, job: LoadJob, hs: Handshake, src_ids: list[int], tokens: list[bytes]) -> None:
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
        for token, src, dst in zip(tokens, src_chunks, dst_chunks):
            n = self.reader.read(addr, token, block_ranges(src_geo, src), self.cache, block_ranges(self.geo, dst))
            self._add("bytes_tcp", n)

    def _notify_done(self, producer: Producer, job: LoadJob, ok: bool) -> str:
        p = job.params
        try:
            reply = call(self.pool, producer, DONE, {"request_id": job.request_id, "transfer_id": p["transfer_id"],
                                                     "lease_id": p["lease_id"], "ok": ok})
        except LoadError as e:
            log.info("p2p done notice for %s not delivered: %s", job.request_id, e)
            return "unreachable"
        return reply.get("status") or ("released" if reply["ok"] else "refused")

    def _release(self, request_id: str, params: dict[str, Any]) -> None:
        job = LoadJob(request_id, [], 0, params, threading.Event())
        try:
            self._notify_done(resolve_producer(params, self.opts), job, ok=False)
        except LoadError as e:
            log.info("p2p release of %s: %s", request_id, e)

    def _add(self, name: str, n: int) -> None:
        with self._lock:
            self.counters[name] += n
