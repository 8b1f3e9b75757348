"""Scheduler side of the P2P connector: pure bookkeeping, no I/O.

Producer (a request with kv_transfer_params.do_remote_decode):
    request_finished (FINISHED_LENGTH: the prefill leg ran its max_tokens=1) -> delay_free=True,
    params for the decode leg, and a LeaseSpec in the next step's metadata: the worker side
    registers the lease; the blocks come back when it reports the request in finished_sending.

Consumer (a request with kv_transfer_params.do_remote_prefill):
    get_num_new_matched_tokens -> (prompt tokens not hit locally, async)
    update_state_after_alloc   -> a LoadSpec for the blocks after the local prefix hits
    request_finished while loading -> a cancel; before any load -> a release (the producer frees)
Sliding window (every layer slides: `window`, the engines free blocks behind it): the decode leg
resumes at token P-1 or P of a P-token prompt, so no block before W = first_needed_block(P - 1)
is ever read again. The producer leases only blocks [W, ceil(P/bs)) (it still holds them: it
freed only behind its own last step, which started at or before P-1) and the consumer loads only
from its own first needed block on (>= W; its blocks before are placeholders, kv_cache_manager),
asking for lease index first - W. Both compute W from P, the window and the block size, which the
handshake fingerprint makes equal ("window_handoff").
A request is loaded at most once: after a load (or a failure cut back under "recompute") it
computes whatever it misses locally, so a preempted decode never pulls stale leases again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pdcluster.engine.kv_connector import KVConnectorMetadata, KVTransferParams
from pdcluster.engine.kv_window import first_needed_block
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.handoff_trace import trace

from .options import P2POptions
from .params import build_params, check_consumer_params, is_hex32, new_id

log = logging.getLogger(__name__)


@dataclass
class P2PMetadata(KVConnectorMetadata):
    """One step's work for the worker side (plain data: broadcast to TP ranks)."""

    leases: list[dict[str, Any]] = field(default_factory=list)  # request_id, transfer_id, lease_id, block_ids
    # request_id, local_block_ids, first_block, params (KVTransferParams.to_wire(): plain data)
    loads: list[dict[str, Any]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    releases: list[dict[str, Any]] = field(default_factory=list)  # request_id, params (to_wire())
    drops: list[str] = field(default_factory=list)  # producer: end these requests' leases now (aborted)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> P2PMetadata:
        """Inverse of to_dict() (the TP step broadcast); TypeError/KeyError when malformed."""
        out = cls(list(d["leases"]), list(d["loads"]), [str(x) for x in d["cancels"]], list(d["releases"]),
                  [str(x) for x in d.get("drops", [])])
        for item in out.leases + out.loads + out.releases:
            if not isinstance(item, dict):
                raise TypeError("p2p metadata entries must be maps")
        return out


def _remote_prefill(req: Request) -> KVTransferParams | None:
    kv = req.kv_transfer_params
    return kv if kv is not None and kv.do_remote_prefill else None


class P2PScheduler:
    def __init__(self, opts: P2POptions, block_size: int, window: int | None = None) -> None:
        self.opts = opts
        self.block_size = block_size
        self.window = window
        self.worker_meta: dict[str, Any] | None = None
        self.all_meta: list[dict[str, Any]] = []
        self._meta = P2PMetadata()
        self._num_local: dict[str, int] = {}  # local prefix hits seen by get_num_new_matched_tokens
        self._handled: set[str] = set()  # consumer requests whose load was issued or skipped
        self._loading: set[str] = set()
        self.counters = {"leases_issued": 0, "loads_issued": 0}

    def set_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.worker_meta = metadata.get(0)
        self.all_meta = [metadata[r] for r in sorted(metadata)]

    # -- consumer --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        kv = _remote_prefill(req)
        if kv is None or req.request_id in self._handled:
            return 0, False
        if not self.opts.is_consumer:
            raise ValueError(f"this engine's kv_role is {self.opts.kv_role!r}: it cannot load remote KV "
                             "(do_remote_prefill)")
        trace("d.match", req.request_id)
        check_consumer_params(kv, req, self.block_size)
        self._num_local[req.request_id] = num_computed_tokens
        return max(0, kv.num_tokens - num_computed_tokens), True

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_external_tokens: int) -> None:
        kv = _remote_prefill(req)
        request_id = req.request_id
        if kv is None or request_id in self._handled:
            return
        self._handled.add(request_id)
        trace("d.alloc", request_id)
        num_local = self._num_local.pop(request_id, 0)
        if num_external_tokens <= 0:  # everything hit locally: the producer may free now
            self._meta.releases.append({"request_id": request_id, "params": kv.to_wire()})
            return
        bs = self.block_size
        first, end = num_local // bs, -(-(num_local + num_external_tokens) // bs)
        if self.window is not None:  # placeholders before this block: nothing there is read again
            first = max(first, first_needed_block(num_local + num_external_tokens, self.window, bs))
        self._meta.loads.append({"request_id": request_id, "local_block_ids": list(block_ids[first:end]),
                                 "first_block": first - self._lease_start(kv.num_tokens), "params": kv.to_wire()})
        self._loading.add(request_id)
        self.counters["loads_issued"] += 1

    def abort_held(self, request_id: str) -> None:
        """Producer: the finished prefill leg was aborted (no decode leg will read it): every rank
        ends its lease now instead of at expiry; a late reader is refused ("aborted")."""
        self._meta.drops.append(request_id)

    def _lease_start(self, num_prompt_tokens: int) -> int:
        """W: the first prompt block a decode leg can read (0 without a window)."""
        if self.window is None:
            return 0
        return first_needed_block(num_prompt_tokens - 1, self.window, self.block_size)

    # -- both ------------------------------------------------------------------------------------
    def build_meta(self) -> P2PMetadata:
        meta, self._meta = self._meta, P2PMetadata()
        return meta

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        request_id = req.request_id
        self._num_local.pop(request_id, None)
        remote = _remote_prefill(req)
        if remote is not None:
            if request_id in self._loading:
                self._meta.cancels.append(request_id)  # stops a load in flight; a no-op once it finished
            elif request_id not in self._handled:
                self._meta.releases.append({"request_id": request_id, "params": remote.to_wire()})
            self._handled.discard(request_id)
            self._loading.discard(request_id)
            return False, None
        kv = req.kv_transfer_params
        if kv is None or not kv.do_remote_decode or not block_ids:
            return False, None
        if req.status != RequestStatus.FINISHED_LENGTH:
            # Stopped at its first token (eos): no decode leg will come. Aborted/failed: nothing to hand over.
            return False, None
        if not self.opts.is_producer or self.worker_meta is None:
            log.warning("request %s asked for a remote decode but this engine has no p2p producer agent", request_id)
            return False, None
        num_blocks = -(-req.num_prompt_tokens // self.block_size)
        leased = list(block_ids[:num_blocks])
        start = self._lease_start(req.num_prompt_tokens)
        if self.window is not None and req.num_computed_tokens > req.num_prompt_tokens:
            # It computed past its prompt (max_tokens > 1): its window may have left block W.
            log.warning("request %s computed past its prompt with a sliding window: no hand-off", request_id)
            return False, None
        transfer_id = kv.transfer_id if is_hex32(kv.transfer_id) else new_id()
        lease_id = new_id()
        self._meta.leases.append({"request_id": request_id, "transfer_id": transfer_id, "lease_id": lease_id,
                                  "block_ids": leased[start:]})
        self.counters["leases_issued"] += 1
        trace("p.finished", request_id)
        return True, build_params(req, leased, self.block_size, self.worker_meta, transfer_id, lease_id,
                                  self.opts.lease_ttl_s, self.opts.params_secret, self.all_meta)
