"""ECFetcher: the consumer half. Fetches planned items (ECConnectorMetadata) from their producers
on its own threads and reports outputs and per-item failures; it never raises into the engine.

Per producer (a CURVE DEALER socket per load thread, kept for the next load; the producer's key must
be on the cluster allow-list):

    fetch(mm_hash, lease_id, fingerprint) --> ready:     read the bytes (shared memory when the
                                                         producer is on this host, else TCP with the
                                                         payload MAC), check the blake3 digest, release
                                          --> not_ready: the item is PENDING: back off, ask again until
                                                         fetch_timeout_s (then errors_not_ready_timeout)
                                          --> missing / evicted / incompatible / ...: that item fails
    no reply within request_timeout_s: the producer is gone; every remaining item of it fails (timeout)

A failed item is encoded locally by the engine; its reason is counted as errors_<reason>.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import blake3
import zmq

from pdcluster.dtypes import ITEMSIZE, torch_dtype
from pdcluster.engine.ec_connector import ECConnectorMetadata, ECFetchError, ECItemLoad, ECLoadReport
from pdcluster.security.curve import make_client_socket, send_before
from pdcluster.security.envelope import MalformedMessage, decode, encode
from pdcluster.security.keys import normalize_public_key
from pdcluster.transfer import SharedRegionCache, TransferClient, TransferError, local_host_id

from .options import ECOptions
from .wire import (
    EVICTED,
    FETCH,
    MAX_FRAME_BYTES,
    MISSING,
    NOT_READY,
    RELEASE,
    REPLIES,
    new_nonce,
    now_ms,
)

log = logging.getLogger(__name__)
_EXPECTED = frozenset({ECFetchError.MISSING, ECFetchError.EVICTED})  # logged at INFO, the rest WARNING
_STATUS_REASON = {MISSING: ECFetchError.MISSING, EVICTED: ECFetchError.EVICTED,
                  "incompatible": ECFetchError.INCOMPATIBLE, "malformed": ECFetchError.MALFORMED}
_MAX_BACKOFF_S = 0.05
_MAX_SOCKETS = 64


class _Failed(Exception):
    def __init__(self, reason: ECFetchError, message: str = "") -> None:
        super().__init__(message or reason.value)
        self.reason = reason


class ECFetcher:
    def __init__(self, opts: ECOptions, fingerprint: str, row_bytes: int | None = None) -> None:
        """row_bytes: the size of one output row here (text hidden x itemsize); an item of another size
        is refused before anything is allocated for it."""
        self.opts = opts
        self.fingerprint = fingerprint
        self.row_bytes = row_bytes
        self._trusted = {normalize_public_key(k) for k in opts.allowed_keys.values()}
        self._ctx = zmq.Context()
        self._pool = ThreadPoolExecutor(opts.num_load_threads, thread_name_prefix="ec-load")
        self._transfer = TransferClient(num_streams=1, connect_timeout_s=opts.request_timeout_s,
                                        io_timeout_s=opts.io_timeout_s)
        self._shm = SharedRegionCache()
        self._host_id = local_host_id()
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        # (thread, address, key) -> its DEALER: one CURVE handshake per producer per load thread.
        self._socks: dict[tuple[int, str, bytes], zmq.Socket] = {}

    def start(self, meta: ECConnectorMetadata) -> Future[ECLoadReport]:
        return self._pool.submit(self._load, meta)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # no load thread uses a socket any more: close them here
        with self._lock:
            socks, self._socks = list(self._socks.values()), {}
        for sock in socks:
            sock.close(linger=0)
        self._transfer.close()
        self._shm.close()
        self._ctx.term()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    # -- load thread ------------------------------------------------------------------------------
    def _load(self, meta: ECConnectorMetadata) -> ECLoadReport:
        report = ECLoadReport(meta.request_id)
        groups: dict[tuple[str, bytes], list[ECItemLoad]] = {}
        for load in meta.loads:
            groups.setdefault((load.producer.address, load.producer.public_key), []).append(load)
        for loads in groups.values():
            try:
                self._load_from(loads, report)
            except Exception:  # a bug costs these items (encoded locally), never the engine
                log.exception("ec fetch failed")
                for load in loads:
                    if load.mm_hash not in report.loaded:
                        report.failed.setdefault(load.mm_hash, ECFetchError.PRODUCER)
        for reason in report.failed.values():
            self._count(f"errors_{reason.value}")
        return report

    def _load_from(self, loads: list[ECItemLoad], report: ECLoadReport) -> None:
        producer = loads[0].producer
        problem = self._check_producer(producer)
        if problem is not None:
            for load in loads:
                report.failed[load.mm_hash] = problem
            return
        sock = self._socket(producer.address, producer.public_key)
        for i, load in enumerate(loads):
            try:
                out = self._load_item(sock, load)
            except _Failed as e:
                # Gone or evicted items are the cache working as designed; anything else is a
                # fault an operator should see, named with its producer (the counter has no peer).
                level = logging.INFO if e.reason in _EXPECTED else logging.WARNING
                log.log(level, "ec fetch of %s from %s (%s) failed: %s: %s; encoding locally", load.mm_hash[:12],
                        producer.producer_id or "?", producer.address, e.reason.value, e)
                report.failed[load.mm_hash] = e.reason
                if e.reason is ECFetchError.TIMEOUT:  # the producer is gone: do not wait again per item
                    self._drop_socket(producer.address, producer.public_key)
                    for rest in loads[i + 1:]:
                        report.failed[rest.mm_hash] = ECFetchError.TIMEOUT
                    return
                continue
            report.loaded[load.mm_hash] = out
            report.nbytes += out.numel() * out.element_size()

    def _socket(self, address: str, key: bytes) -> zmq.Socket:
        k = (threading.get_ident(), address, key)
        with self._lock:
            sock = self._socks.get(k)
        if sock is None:
            sock = make_client_socket(self._ctx, zmq.DEALER, self.opts.keypair, key, f"tcp://{address}")
            with self._lock:
                # Addresses come from request data: keep at most _MAX_SOCKETS, closing this thread's oldest.
                mine = [other for other in self._socks if other[0] == k[0]]
                old = self._socks.pop(mine[0]) if len(self._socks) >= _MAX_SOCKETS and mine else None
                self._socks[k] = sock
            if old is not None:
                old.close(linger=0)
        return sock

    def _drop_socket(self, address: str, key: bytes) -> None:
        with self._lock:
            sock = self._socks.pop((threading.get_ident(), address, key), None)
        if sock is not None:
            sock.close(linger=0)

    def _check_producer(self, producer: Any) -> ECFetchError | None:
        try:
            key = normalize_public_key(producer.public_key)
        except Exception:
            return ECFetchError.UNTRUSTED
        if key not in self._trusted:  # request data must not make us talk to a stranger
            return ECFetchError.UNTRUSTED
        host, sep, port = producer.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "*" in host or "/" in host:
            return ECFetchError.MALFORMED
        if producer.fingerprint and producer.fingerprint != self.fingerprint:
            return ECFetchError.INCOMPATIBLE
        return None

    def _load_item(self, sock: zmq.Socket, load: ECItemLoad) -> Any:
        deadline = time.monotonic() + self.opts.fetch_timeout_s
        backoff = 0.002
        while True:
            reply = self._round_trip(sock, FETCH, {"fingerprint": self.fingerprint, "mm_hash": load.mm_hash,
                                                   "lease_id": load.ref.lease_id})
            if reply["status"] != NOT_READY:
                break
            self._count("not_ready_retries")
            if time.monotonic() + backoff > deadline:
                raise _Failed(ECFetchError.NOT_READY_TIMEOUT, "still pending at the fetch deadline")
            time.sleep(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)
        if not reply["ok"]:
            raise _Failed(_STATUS_REASON.get(reply["status"], ECFetchError.PRODUCER), reply.get("error") or "")
        try:
            out = self._read(reply, load)
        finally:  # the grant pins the item: end it whatever happened to the bytes
            self._release(sock, load, reply.get("grant_id"))
        return out

    def _release(self, sock: zmq.Socket, load: ECItemLoad, grant_id: str | None) -> None:
        if not grant_id:
            return
        try:
            reply = self._round_trip(sock, RELEASE, {"mm_hash": load.mm_hash, "grant_id": grant_id,
                                                     "lease_id": load.ref.lease_id})
            self._count(f"release_{reply['status']}")
        except _Failed:
            self._count("release_failed")

    def _round_trip(self, sock: zmq.Socket, schema: Any, fields: dict[str, Any]) -> dict[str, Any]:
        nonce = new_nonce()
        end = time.monotonic() + self.opts.request_timeout_s
        # No pipe to send on while the producer refuses our key: a plain send would block for ever.
        if not send_before(sock, encode(schema, {"nonce": nonce, "ts_ms": now_ms(), **fields}, MAX_FRAME_BYTES), end):
            raise _Failed(ECFetchError.TIMEOUT, f"the producer did not take the request within {self.opts.request_timeout_s}s")
        while True:
            left = end - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                raise _Failed(ECFetchError.TIMEOUT, f"no reply within {self.opts.request_timeout_s}s")
            frames = sock.recv_multipart()
            if len(frames) != 2 or frames[0] != nonce:
                continue  # a late reply to an earlier request, or garbage: not ours
            try:
                _, body = decode(REPLIES, frames[1], MAX_FRAME_BYTES)
            except MalformedMessage as e:
                raise _Failed(ECFetchError.MALFORMED, str(e)) from None
            return body

    def _read(self, reply: dict[str, Any], load: ECItemLoad) -> Any:
        import torch

        shape, dtype, nbytes = reply.get("shape"), reply.get("dtype"), reply.get("nbytes")
        fields = ("token", "digest", "offset", "region_id", "data_host", "data_port")
        if not shape or dtype not in ITEMSIZE or "float8" in str(dtype) or nbytes is None \
                or any(reply.get(k) is None for k in fields):
            raise _Failed(ECFetchError.MALFORMED, "ready reply without a complete item description")
        expected = None if self.row_bytes is None else load.num_tokens * self.row_bytes
        if math.prod(shape) * ITEMSIZE[dtype] != nbytes or shape[0] != load.num_tokens \
                or (expected is not None and nbytes != expected):
            raise _Failed(ECFetchError.MALFORMED, f"item shape {shape} {dtype} does not fit {nbytes} bytes / "
                                                  f"{load.num_tokens} placeholders")
        dest = torch.empty(nbytes, dtype=torch.uint8)
        view = dest.numpy()
        if not self._read_shm(reply, view):
            try:
                mac_key = reply.get("mac_key") if self.opts.data_mac else None
                self._transfer.read((reply["data_host"], reply["data_port"]), reply["token"],
                                    [(reply["offset"], nbytes)], dest, mac_key=mac_key)
            except TransferError as e:
                raise _Failed(ECFetchError.INTEGRITY if e.status == "integrity" else ECFetchError.TRANSFER,
                              str(e)) from None
            self._count("fetched_tcp")
        if blake3.blake3(view).digest() != reply["digest"]:
            raise _Failed(ECFetchError.INTEGRITY, "the item's bytes do not match its digest")
        self._count("transfer_bytes", nbytes)
        return dest.view(torch_dtype(dtype)).reshape(shape)

    def _read_shm(self, reply: dict[str, Any], view: Any) -> bool:
        if self.opts.transport == "tcp" or reply.get("host_id") != self._host_id or not reply.get("shm_name"):
            if self.opts.transport == "shm":
                raise _Failed(ECFetchError.TRANSFER, "transport=shm but the producer is not on this host")
            return False
        try:
            region = self._shm.get(reply["shm_name"], reply.get("region_nbytes") or 0, writable=False)
            off = reply["offset"]
            if off + view.nbytes > region.nbytes:
                raise _Failed(ECFetchError.MALFORMED, "item outside the producer's region")
            view[:] = memoryview(region.view)[off:off + view.nbytes]
        except (OSError, ValueError) as e:
            if self.opts.transport == "shm":
                raise _Failed(ECFetchError.TRANSFER, f"shared memory: {e}") from None
            return False  # e.g. two containers with one hostname: TCP it is
        self._count("fetched_shm")
        return True
