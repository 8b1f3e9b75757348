"""ECProducer: the producer half. Owns the shared-memory region the encoder outputs live in (one
Region registered with a TransferServer of the shared data plane), the ItemStore, and the answers
to control requests.

Capabilities: a consumer gets a READ token only in the CURVE reply to a fetch of a READY item. The
token covers exactly that item's bytes, is bound to a fresh grant (a lease of its own: the item is
pinned while the grant lives, and the TransferServer refuses the token once the grant ended), is
single use, and comes with its payload-MAC key. Each reply also carries the item's blake3 digest,
which the consumer checks on whatever path the bytes took (TCP or shared memory).

`handle()` is pure request -> reply logic (no sockets), so it is tested frame by frame. It never
raises: every malformed, replayed, incompatible or oversized message gets an error reply and a
counter; nothing is ever unpickled (msgpack only, ext types off, size checked before decoding).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import Counter
from typing import Any

import blake3

from pdcluster.engine.ec_connector import ECItemState
from pdcluster.security.envelope import (
    RefusedRequest,
    ReplayGuard,
    encode,
    open_request,
)
from pdcluster.transfer import OP_READ, Capability, TransferServer, alloc_region, issue_token, local_host_id
from pdcluster.transfer.integrity import transfer_mac_key

from .item_store import ItemStore, StoreFull
from .options import ECOptions
from .wire import (
    EVICTED,
    EXPIRED,
    MAX_FRAME_BYTES,
    MISSING,
    NOT_READY,
    READY,
    RELEASED,
    REPLY,
    REQUESTS,
    now_ms,
)

log = logging.getLogger(__name__)
REPLAY_WINDOW_S = 60.0


class ECProducer:
    def __init__(self, opts: ECOptions, fingerprint: str) -> None:
        self.opts = opts
        self.fingerprint = fingerprint
        self.epoch = secrets.randbits(62) | 1
        self.store = ItemStore(opts.max_bytes, opts.max_items, opts.lease_s)
        self.region = alloc_region(opts.max_bytes, shared=True)
        self._data_key = secrets.token_bytes(32)  # tokens are minted and verified in this process only
        self._guard = ReplayGuard(window_s=REPLAY_WINDOW_S)
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self._serial = 0
        try:
            self.server = TransferServer(self._data_key, opts.data_host or opts.host, 0,
                                         io_timeout_s=opts.io_timeout_s, single_use=True,
                                         on_refusal=lambda reason: self._count(f"data_refused_{reason}"),
                                         authorize=self._grant_live)
            self.region_id = self.server.register(self.region)
            host, port = self.server.address  # read once: a stopped server has no address
            if host in ("0.0.0.0", "::", "[::]"):  # a wildcard bind is not an address a consumer can dial
                if not opts.advertise_host:
                    raise ValueError("p2p_ec data_host is a wildcard address: set advertise_host")
                host = opts.advertise_host
            self.data_address = (host, port)
            self.server.start()
        except BaseException:
            server = getattr(self, "server", None)
            if server is not None:
                server.stop()
            self.region.close()
            raise

    # -- engine thread ----------------------------------------------------------------------------
    def save(self, mm_hash: str, output: Any) -> bool:
        """Copy one output into the region: PENDING -> READY. False when it cannot be held."""
        import torch

        t = output.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        src = t.reshape(-1).view(torch.uint8).numpy()
        try:
            offset = self.store.allocate(mm_hash, src.nbytes)
        except StoreFull as e:
            self._count("save_refused_full")
            log.debug("ec producer: not holding %s: %s", mm_hash[:12], e)
            return False
        if offset is None:  # already READY
            return True
        try:
            self.region.view[offset:offset + src.nbytes] = memoryview(src).cast("B")
            digest = blake3.blake3(src).digest()
        except BaseException:
            self.store.abandon(mm_hash)
            raise
        self.store.commit(mm_hash, tuple(t.shape), str(t.dtype).removeprefix("torch."), digest)
        return True

    def announce(self, mm_hashes: list[str]) -> list[tuple[str, str, int, int]]:
        """A lease per READY item: [(mm_hash, lease_id, nbytes, num_tokens)] (others are skipped)."""
        out = []
        for h in mm_hashes:
            lease = self.store.lease(h)
            item = self.store.get(h) if lease is not None else None
            if lease is not None and item is not None:
                out.append((h, lease.lease_id, item.nbytes, item.shape[0] if item.shape else 0))
        return out

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.store.stats())
        with self._lock:
            out.update({f"producer_{k}": v for k, v in self.counters.items()})
        server = self.server.stats()
        out["producer_bytes_served"] = server.get("bytes_read", 0)
        # Refused data-plane connections (garbage, bad or replayed tokens, header timeouts): the
        # connector exports them as errors_data_refused, beside its control-port refusals.
        out["producer_data_refused"] = server.get("refused_total", 0)
        return out

    def close(self) -> None:
        self.server.stop()
        self.server.unregister(self.region_id)
        self.region.close()

    # -- data-plane threads -----------------------------------------------------------------------
    def _grant_live(self, cap: Capability) -> str | None:
        return None if self.store.live_lease(cap.transfer_id.hex()) is not None else "grant_ended"

    # -- control thread ---------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def handle(self, frames: list[bytes], sender: str | None = None) -> list[bytes]:
        """Reply frames (after the ROUTER identity) for one request's frames. Never raises."""
        if len(frames) == 1 and len(frames[0]) > MAX_FRAME_BYTES:
            return self._error(b"", "too_large", f"message of {len(frames[0])} bytes > {MAX_FRAME_BYTES}")
        try:
            kind, body, nonce = open_request(frames, REQUESTS, MAX_FRAME_BYTES, self._guard, self._lock)
        except RefusedRequest as e:
            return self._error(e.nonce, e.reason, str(e))
        self._count(f"requests_{kind}")
        try:
            if kind == "ec_fetch":
                return self._fetch(nonce, body, sender)
            live = self.store.release(body["grant_id"], body["mm_hash"], sender)
            if body["lease_id"]:  # the announced lease: the consumer has what it came for
                self.store.release(body["lease_id"], body["mm_hash"])
            return self._reply(nonce, ok=live, status=RELEASED if live else EXPIRED)
        except Exception as e:  # a bug costs this request only
            log.exception("ec control: %s failed", kind)
            return self._error(nonce, "internal", f"internal error: {type(e).__name__}")

    def _fetch(self, nonce: bytes, body: dict[str, Any], sender: str | None) -> list[bytes]:
        if body["fingerprint"] != self.fingerprint:
            return self._error(nonce, "incompatible", "incompatible encoder: compatibility fingerprints differ "
                                                      "(model, dtype, vision/projector config or connector version)")
        mm_hash = body["mm_hash"]
        state = self.store.state(mm_hash)
        if state is ECItemState.PENDING:  # retryable, and distinct from MISSING
            self._count("not_ready")
            return self._reply(nonce, ok=False, status=NOT_READY)
        if state in (ECItemState.ABSENT, ECItemState.EVICTED):
            status = MISSING if state is ECItemState.ABSENT else EVICTED
            return self._error(nonce, status, f"item {mm_hash[:12]} is {state.value}")
        if body["lease_id"] and self.store.live_lease(body["lease_id"], mm_hash) is None:
            self._count("fetch_lease_ended")  # served anyway while the item is there: the digest guards it
        grant = self.store.lease(mm_hash, owner=sender)
        item = self.store.get(mm_hash)
        if grant is None or item is None:  # evicted between the two looks
            return self._error(nonce, EVICTED, f"item {mm_hash[:12]} is evicted")
        expiry_ms = now_ms() + int(self.opts.lease_s * 1000)
        with self._lock:
            self._serial = (self._serial + 1) & 0xFFFFFFFF
            serial = self._serial
        token = issue_token(self._data_key, bytes.fromhex(grant.lease_id), OP_READ, self.region_id,
                            [(item.offset, item.nbytes)], expiry_ms=expiry_ms, serial=serial)
        host, port = self.data_address
        self._count("served")
        return self._reply(nonce, status=READY, grant_id=grant.lease_id, token=token,
                           mac_key=transfer_mac_key(self._data_key, token), region_id=self.region_id,
                           offset=item.offset, nbytes=item.nbytes, shape=list(item.shape), dtype=item.dtype,
                           digest=item.digest, data_host=host, data_port=port, host_id=local_host_id(),
                           shm_name=self.region.shm_name, region_nbytes=self.region.nbytes)

    def _reply(self, nonce: bytes, ok: bool = True, **fields: Any) -> list[bytes]:
        return [nonce, encode(REPLY, {"ok": ok, "epoch": self.epoch, **fields})]

    def _error(self, nonce: bytes, status: str, message: str) -> list[bytes]:
        self._count(f"refused_{status}")
        return self._reply(nonce, ok=False, status=status, error=message[:500])
