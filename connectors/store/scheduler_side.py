"""StoreScheduler: the store connector's scheduler half. Bookkeeping plus one lookup per request.

Lookup (get_num_new_matched_tokens): one batch_exists over every shard of every full block of the
request. A block is usable when all S shards exist; the match is the longest run of blocks from
the start that are local prefix hits or usable, in whole blocks, capped one token short of the
request (the last token is always computed). Loads are asynchronous: the request waits in
WAITING_FOR_REMOTE_KV while the worker ranks read and unpack.

Saves (build_connector_meta): every step, each scheduled request's blocks that are full once the
step's forward ran, that the store did not have at lookup, and that this instance did not save
recently, go to the worker ranks. Blocks loaded in a step are never saved (they were present),
and a request is never scheduled while its load runs, so one step never saves and loads a block.

Finish (request_finished): a request with saves in flight keeps its blocks (delay_free) until
every rank reports them written (finished_sending); so does a prefill leg of a disaggregated
request, whose params promise the store holds its prompt's blocks. A decode leg holding such a
promise waits (None: ask again) up to wait_for_producer_s for those blocks to appear.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pdcluster.engine.block_pool import KVEvent
from pdcluster.engine.kv_connector import KVTransferParams
from pdcluster.engine.outputs import SchedulerOutput
from pdcluster.engine.request import Request

from .backend import StoreBackend, StoreBackendError
from .backend_factory import make_backend
from .events import StoredBlockTracker
from .meta import BlockSpec, StoreConnectorMetadata, StoreHandoff
from .options import StoreOptions

_PRODUCER_ID = f"{socket.gethostname()}-{os.getpid()}"

log = logging.getLogger(__name__)
MAX_RECENT = 1 << 16
LOOKUP_TTL_S = 0.5  # a request blocked on free blocks reuses its lookup this long
WAIT_REQUERY_S = 0.01  # while waiting for a producer's saves, ask the store at most this often
# A block this instance saved but a lookup finds missing is saved again only after this long: before
# it the save is most likely still in flight; after it, it failed or the block was evicted.
RESAVE_AFTER_S = 5.0


@dataclass
class _ReqState:
    request: Request
    block_ids: list[int]
    present: list[bool]  # per full block at lookup: all shards in the store
    next_save: int = 0  # blocks before it were already considered for saving
    saved_any: bool = False
    loading: bool = False


class StoreScheduler:
    def __init__(self, opts: StoreOptions, block_size: int, backend: StoreBackend | None = None) -> None:
        self.opts = opts
        self.layout = opts.layout
        self.block_size = block_size
        self._backend = backend if backend is not None else make_backend(opts.backend, opts.backend_options)
        self.tracker = StoredBlockTracker(self._backend, self.layout, opts.event_poll_s)
        self._reqs: dict[str, _ReqState] = {}
        self._lookups: dict[str, tuple[float, list[bool]]] = {}
        self._first_seen: dict[str, float] = {}
        self._match: dict[str, tuple[int, list[bool]]] = {}  # request_id -> (num local tokens, present)
        self._loads: list[BlockSpec] = []
        self._finished: list[str] = []
        self._cancels: list[str] = []
        self._recent: OrderedDict[bytes, float] = OrderedDict()  # hash -> when this instance saved it
        self._down_until = 0.0
        self._foreign: set[str] = set()  # decode legs whose producer used another key prefix (counted once)
        self._warned_prefixes: set[Any] = set()
        self.counters: dict[str, int] = {"lookups": 0, "lookup_errors": 0, "hit_tokens": 0, "query_tokens": 0,
                                         "load_requests": 0, "save_blocks": 0, "foreign_key_prefix": 0}

    # -- lookup ----------------------------------------------------------------------------------
    def _lookup(self, req: Request, max_age_s: float) -> list[bool] | None:
        now = time.monotonic()
        cached = self._lookups.get(req.request_id)
        if cached is not None and now - cached[0] <= max_age_s:
            return cached[1]
        hashes = list(req.block_hashes)
        if not hashes:
            return []
        if now < self._down_until:
            return None
        try:
            exists = self._backend.batch_exists(self.layout.keys_for(hashes))
        except StoreBackendError as e:
            self.counters["lookup_errors"] += 1
            self._down_until = now + self.opts.retry_after_error_s
            log.warning("store lookup failed (not asking again for %.1fs): %s", self.opts.retry_after_error_s, e)
            return None
        self.counters["lookups"] += 1
        present = self.layout.blocks_present(hashes, exists)
        self.tracker.saw_missing([h for h, ok in zip(hashes, present) if not ok])
        for h, ok in zip(hashes, present):
            if not ok and now - self._recent.get(h, now) > RESAVE_AFTER_S:
                del self._recent[h]  # evicted or never landed: may be saved again
        self._lookups[req.request_id] = (now, present)
        return present

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        request_id, bs = req.request_id, self.block_size
        now = time.monotonic()
        first_seen = self._first_seen.setdefault(request_id, now)
        promised = self._promised_blocks(req)
        waiting = promised > 0 and now - first_seen < self.opts.wait_for_producer_s
        present = self._lookup(req, WAIT_REQUERY_S if waiting else LOOKUP_TTL_S)
        if present is None:  # store unreachable: compute locally, still try to save
            self._match[request_id] = (num_computed_tokens, [])
            return 0, False
        num_local_blocks = num_computed_tokens // bs
        n = 0
        while n < len(present) and (n < num_local_blocks or present[n]):
            n += 1
        if waiting and n < promised:
            return None, False  # the producer's saves are still landing: ask again next step
        num_ext = max(0, min(n * bs, req.num_tokens - 1) - num_computed_tokens) if self.opts.load else 0
        self._match[request_id] = (num_computed_tokens, present)
        return num_ext, num_ext > 0

    def _promised_blocks(self, req: Request) -> int:
        """Blocks a decode leg's params say the producer saved, if they are this prompt's blocks."""
        p = req.kv_transfer_params
        if p is None or not p.do_remote_prefill or p.connector != "store":
            return 0
        handoff = StoreHandoff.of(p)
        if handoff is None:
            return 0
        if handoff.key_prefix != self.layout.key_prefix:
            self._foreign_prefix(req, handoff.key_prefix)
            return 0
        blocks = min(p.num_tokens // self.block_size, len(req.block_hashes))
        # Mismatched params (another prompt's) must not make this request wait for nothing.
        return blocks if blocks and req.block_hashes[blocks - 1].hex() == handoff.last_hash else 0

    def _foreign_prefix(self, req: Request, prefix: Any) -> None:
        """A decode leg whose producer names blocks differently can never load them: say so (once
        per prefix), it is a deployment error, not a cache miss."""
        if req.request_id in self._foreign:
            return
        self._foreign.add(req.request_id)
        self.counters["foreign_key_prefix"] += 1
        if prefix not in self._warned_prefixes and len(self._warned_prefixes) < 64:
            self._warned_prefixes.add(prefix)
            log.warning("store connector: request %s's producer stored its prompt under key prefix %r, this "
                        "instance uses %r: they differ in namespace, model, dtype, kv_cache_dtype (or fp8 KV "
                        "scales), layout, block size or store_tp_size (give every instance sharing the store the same tp_sizes or "
                        "store_tp_size), so this instance computes the prompt itself",
                        req.request_id, prefix, self.layout.key_prefix)

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_external_tokens: int) -> None:
        request_id = req.request_id
        match = self._match.pop(request_id, None)
        st = self._reqs.get(request_id)
        if match is None:  # admitted with blocks a finished load filled: the load is over
            if st is None:
                st = self._reqs[request_id] = _ReqState(req, [], [])
            st.block_ids, st.loading = list(block_ids), False
            return
        num_local, present = match
        st = self._reqs[request_id] = _ReqState(req, list(block_ids), present)
        self.counters["query_tokens"] += req.num_tokens  # per admission, not per retried lookup
        self.counters["hit_tokens"] += num_external_tokens
        if num_external_tokens > 0:
            first = num_local // self.block_size
            last = -(-(num_local + num_external_tokens) // self.block_size)
            self._loads.append(BlockSpec(request_id, list(block_ids[first:last]), list(req.block_hashes[first:last])))
            st.loading = True
            self.counters["load_requests"] += 1

    # -- per step --------------------------------------------------------------------------------
    def build_meta(self, so: SchedulerOutput) -> StoreConnectorMetadata:
        meta = StoreConnectorMetadata(self._loads, [], self._finished, self._cancels)
        self._loads, self._finished, self._cancels = [], [], []
        if not self.opts.save:
            return meta
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.request_id)
            if st is not None:
                st.block_ids = list(new.block_ids)
                self._add_saves(st, new.num_computed_tokens + so.num_scheduled_tokens.get(new.request_id, 0), meta)
        for c in so.scheduled_cached_reqs:
            st = self._reqs.get(c.request_id)
            if st is not None:
                st.block_ids.extend(c.new_block_ids)
                self._add_saves(st, c.num_computed_tokens + so.num_scheduled_tokens.get(c.request_id, 0), meta)
        return meta

    def _add_saves(self, st: _ReqState, num_tokens_after: int, meta: StoreConnectorMetadata) -> None:
        req = st.request
        if not self.opts.save_decode_blocks:
            num_tokens_after = min(num_tokens_after, req.num_prompt_tokens)
        end = min(num_tokens_after // self.block_size, len(req.block_hashes), len(st.block_ids))
        run: list[int] = []  # consecutive block indices to save: one spec per run keeps chains whole
        for i in range(st.next_save, end):
            if (i < len(st.present) and st.present[i]) or req.block_hashes[i] in self._recent:
                continue
            if run and run[-1] != i - 1:
                self._emit_save(st, run, meta)
                run = []
            run.append(i)
        st.next_save = max(st.next_save, end)
        if run:
            self._emit_save(st, run, meta)

    def _emit_save(self, st: _ReqState, run: list[int], meta: StoreConnectorMetadata) -> None:
        req = st.request
        hashes = [req.block_hashes[i] for i in run]
        meta.saves.append(BlockSpec(req.request_id, [st.block_ids[i] for i in run], hashes))
        st.saved_any = True
        self.counters["save_blocks"] += len(run)
        self.tracker.expect(hashes, req.block_hashes[run[0] - 1] if run[0] else None)
        now = time.monotonic()
        for h in hashes:
            self._recent[h] = now
            self._recent.move_to_end(h)
            if len(self._recent) > MAX_RECENT:
                self._recent.popitem(last=False)

    # -- finish ----------------------------------------------------------------------------------
    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        request_id = req.request_id
        st = self._reqs.pop(request_id, None)
        for d in (self._lookups, self._first_seen, self._match):
            d.pop(request_id, None)
        self._foreign.discard(request_id)
        if st is not None and st.loading:
            self._cancels.append(request_id)
        params = self._producer_params(req)
        delay_free = bool(block_ids) and ((st is not None and st.saved_any) or params is not None)
        if delay_free:
            self._finished.append(request_id)
        return delay_free, params

    def _producer_params(self, req: Request) -> KVTransferParams | None:
        p = req.kv_transfer_params
        if p is None or not p.do_remote_decode:
            return None
        blocks = min(req.num_prompt_tokens // self.block_size, len(req.block_hashes))
        # producer_id and num_tokens are what every consumer leg carries (worker/roles.py); the
        # store finds blocks by hash, so the producer's identity is for diagnostics only. Without
        # one full block (num_tokens 0) the decode leg computes the prompt itself.
        handoff = StoreHandoff(self.layout.key_prefix, req.block_hashes[blocks - 1].hex() if blocks else "")
        return KVTransferParams(connector="store", producer_id=_PRODUCER_ID, request_id=req.request_id,
                                num_tokens=blocks * self.block_size, extra=handoff.into({}))

    def take_events(self) -> list[KVEvent]:
        return self.tracker.take()

    def stats(self) -> dict[str, Any]:
        out = {f"store_{k}": v for k, v in self.counters.items()}
        q = self.counters["query_tokens"]
        out["store_hit_rate"] = self.counters["hit_tokens"] / q if q else 0.0
        return out

    def shutdown(self) -> None:
        self.tracker.close()
        self._backend.close()


__all__ = ["StoreScheduler"]
