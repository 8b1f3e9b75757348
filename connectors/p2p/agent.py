"""ProducerAgent: one worker rank's producer half. It owns the data plane (a TransferServer over
the rank's registered KV cache), the leases, and the answers to side-channel requests.

Capabilities: a consumer gets READ tokens only through `open`, over the CURVE side channel, for
a live lease bound to its (request_id, transfer_id). A token covers exactly the byte ranges of
that lease's blocks and expires when the lease does at the time of `open`; the TransferServer
checks it, and also that the lease is still live (a token dies with its lease) and that no part
of it is presented twice (single use: a replay is refused and counted as data_refused_replayed).
With each token goes its payload MAC key (pdcluster.transfer.integrity), over the same CURVE
reply, so the consumer can check every window it reads. Reads are then validated at the end: the consumer's `done` is answered
"released" only if the lease was still alive, so a read that raced an expiry (blocks freed and
possibly reused) is reported to the reader as failed, never used.

`handle()` is pure request -> reply logic (no sockets), so it is tested frame by frame.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import Counter
from typing import Any

from pdcluster.security.envelope import (
    RefusedRequest,
    ReplayGuard,
    encode,
    open_request,
)
from pdcluster.transfer import OP_READ, Capability, Region, TransferServer, issue_token, local_host_id
from pdcluster.transfer.integrity import transfer_mac_key

from .blocks import CacheGeometry, block_ranges, chunk_block_ids
from .lease import LeaseError, LeaseTable
from .options import P2POptions
from .tp_plan import expected_notices
from .wire import (
    FINGERPRINT,
    HS_BODY,
    MAX_FRAME_BYTES,
    REPLY,
    REQUESTS,
    fingerprint_mismatch,
    now_ms,
)

log = logging.getLogger(__name__)
REPLAY_WINDOW_S = 60.0


class ProducerAgent:
    def __init__(self, opts: P2POptions, fp: dict[str, Any], geo: CacheGeometry, region: Region,
                 shm_name: str | None, tp_rank: int = 0, tp_size: int = 1,
                 total_heads: int | None = None) -> None:
        self.opts = opts
        self.fingerprint = fp
        self.geo = geo
        # A fresh epoch per agent: a restarted producer is a new incarnation whose block ids mean
        # nothing to params minted by the old one.
        self.epoch = secrets.randbits(62) | 1
        self.shm_name = shm_name
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.total_heads = total_heads if total_heads is not None else int(fp.get("num_kv_heads") or tp_size)
        self.leases = LeaseTable(opts.lease_ttl_s)
        self._data_key = secrets.token_bytes(32)  # tokens are minted and verified in this process only
        self._guard = ReplayGuard(window_s=REPLAY_WINDOW_S)
        self._guard_lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self._serial = 0  # per grant, so two opens of one lease never mint the same token
        self.server = TransferServer(self._data_key, opts.data_host, 0, io_timeout_s=opts.io_timeout_s,
                                     on_refusal=lambda reason: self._count(f"data_refused_{reason}"),
                                     single_use=True, authorize=self._lease_of)
        self.region_id = self.server.register(region)
        self.server.start()

    # -- engine thread -------------------------------------------------------------------------
    def add_lease(self, request_id: str, transfer_id: str, lease_id: str, block_ids: list[int]) -> None:
        self.leases.add(request_id, transfer_id, lease_id, block_ids)

    def body(self) -> dict[str, Any]:
        host, port = self.server.address
        return {"producer_id": self.opts.engine_id, "epoch": self.epoch, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "data_host": host, "data_port": port, "region_id": self.region_id,
                "region_nbytes": self.geo.nbytes, "num_blocks": self.geo.num_blocks,
                "block_nbytes": self.geo.block_nbytes, "host_id": local_host_id(), "shm_name": self.shm_name}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"p2p_leases_{k}": v for k, v in self.leases.counts.items()}
        out["p2p_leases_active"] = self.leases.num_active
        with self._guard_lock:
            out.update({f"p2p_{k}": v for k, v in self.counters.items()})
        out["p2p_bytes_served"] = self.server.stats().get("bytes_read", 0)
        return out

    def close(self) -> None:
        self.leases.end_all()
        self.server.stop()

    # -- data-plane threads ----------------------------------------------------------------------
    def _lease_of(self, cap: Capability) -> str | None:
        """The TransferServer's per-request check: None while the token's lease lives."""
        return None if self.leases.transfer_live(cap.transfer_id.hex()) else "lease_ended"

    # -- side-channel thread -------------------------------------------------------------------
    def _count(self, name: str) -> None:
        with self._guard_lock:
            self.counters[name] += 1

    def handle(self, frames: list[bytes], sender: str | None = None) -> list[bytes]:
        """Reply frames (after the ROUTER identity) for one request's frames. Never raises.
        sender: the authenticated peer (the ZAP User-Id: its CURVE key's name); lease operations
        are checked against it (the first consumer to use a lease owns it)."""
        try:
            kind, body, nonce = open_request(frames, REQUESTS, MAX_FRAME_BYTES, self._guard, self._guard_lock)
        except RefusedRequest as e:
            return self._error(e.nonce, e.reason, str(e))
        self._count(f"requests_{kind}")
        try:
            if kind == "p2p_hs_req":
                return self._handshake(nonce, body)
            if kind == "p2p_open":
                return self._open(nonce, body, sender)
            if kind == "p2p_heartbeat":
                alive = [ref["lease_id"] for ref in body["leases"]
                         if self.leases.renew(ref["lease_id"], ref["transfer_id"], sender)]
                return self._reply(nonce, alive=alive, ttl_ms=int(self.leases.ttl_s * 1000))
            consumer_tp = body.get("consumer_tp") or 1
            consumer_rank = body.get("consumer_rank") or 0
            if consumer_rank >= consumer_tp:
                return self._error(nonce, "bad_request", f"consumer_rank {consumer_rank} >= consumer_tp {consumer_tp}")
            try:
                expected = expected_notices(self.total_heads, self.tp_size, consumer_tp, self.tp_rank)
            except ValueError as e:
                return self._error(nonce, "bad_request", str(e))
            status = self.leases.release(body["lease_id"], body["transfer_id"], body["request_id"],
                                         consumer_rank, expected, sender)
            if status != "released":
                self._count(f"refused_done_{status}")
            return self._reply(nonce, ok=status == "released", status=status)
        except LeaseError as e:
            return self._error(nonce, f"lease_{e.reason}", f"lease {e.reason}")
        except Exception as e:  # a bug costs this request only
            log.exception("p2p side channel: %s failed", kind)
            return self._error(nonce, "internal", f"internal error: {type(e).__name__}")

    def _handshake(self, nonce: bytes, body: dict[str, Any]) -> list[bytes]:
        problem = fingerprint_mismatch(self.fingerprint, body["fingerprint"])
        if problem is not None:
            return self._error(nonce, "incompatible", problem)
        return [nonce, encode(FINGERPRINT, self.fingerprint), encode(HS_BODY, self.body())]

    def _open(self, nonce: bytes, body: dict[str, Any], sender: str | None = None) -> list[bytes]:
        lease = self.leases.lookup(body["lease_id"], body["transfer_id"], body["request_id"], sender)
        first = body["first_block"]
        if first > len(lease.block_ids):
            return self._error(nonce, "bad_request", f"first_block {first} past the lease's {len(lease.block_ids)} blocks")
        block_ids = lease.block_ids[first:]
        remaining_ms = int(self.leases.remaining_s(lease) * 1000)
        expiry_ms = now_ms() + remaining_ms
        tid = bytes.fromhex(lease.transfer_id)
        tokens = []
        for chunk in chunk_block_ids(block_ids, self.geo.num_layers):
            if chunk:
                self._serial = (self._serial + 1) & 0xFFFFFFFF
                tokens.append(issue_token(self._data_key, tid, OP_READ, self.region_id, block_ranges(self.geo, chunk),
                                          expiry_ms=expiry_ms, serial=self._serial))
        mac_keys = [transfer_mac_key(self._data_key, token) for token in tokens]
        return self._reply(nonce, block_ids=block_ids, tokens=tokens, mac_keys=mac_keys, expiry_ms=expiry_ms,
                           ttl_ms=int(self.leases.ttl_s * 1000))

    def _reply(self, nonce: bytes, ok: bool = True, **fields: Any) -> list[bytes]:
        return [nonce, encode(REPLY, {"ok": ok, "epoch": self.epoch, **fields})]

    def _error(self, nonce: bytes, reason: str, message: str) -> list[bytes]:
        self._count(f"refused_{reason}")
        return self._reply(nonce, ok=False, error=message[:500])
