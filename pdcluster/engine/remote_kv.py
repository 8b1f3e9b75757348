"""RemoteKV: the scheduler's bookkeeping for KV that a connector moves (loads and hand-offs).

It owns three things the scheduler would otherwise interleave with plain scheduling:

    loading      WAITING_FOR_REMOTE_KV request id -> num_computed_tokens once its load lands
    held         finished requests whose blocks a connector still uses, until
                 finished_sending (a hand-off: delay_free) and finished_recving (a load still
                 writing into them) have both been reported
    invalid      blocks whose load failed: the connector's failure policy, request by request

The scheduler keeps the queues (requests, waiting, running); RemoteKV tells it which loaded
requests are ready again and asks it (fail / preempt callbacks) to act on failed loads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.kv_connector import KVConnectorBase, KVTransferFailure
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.handoff_trace import trace

logger = logging.getLogger(__name__)


class RemoteKV:
    def __init__(self, kv: KVCacheManager, connector: KVConnectorBase | None, block_size: int) -> None:
        self.kv = kv
        self.connector = connector
        self.block_size = block_size
        # WAITING_FOR_REMOTE_KV id -> num_computed_tokens once loaded, in admission order (the
        # order loaded requests rejoin the waiting queue).
        self.loading: dict[str, int] = {}
        self.held: dict[str, Request] = {}  # finished, blocks still used by a transfer
        self._await_sending: set[str] = set()
        self._await_recving: set[str] = set()

    # == admission =================================================================================
    def match(self, request: Request, held: bool) -> tuple[list, int, int, bool] | None:
        """(local prefix hits, num local tokens, num tokens the connector loads, asynchronously?)
        for a waiting request; None when the connector cannot tell yet. A request holding blocks
        already (loaded, not yet run) matches nothing new."""
        if held:
            return [], 0, 0, False
        hits, num_local = self.kv.get_computed_blocks(request)
        # Prompt logprobs need every prompt position's hidden state: nothing cached or loaded.
        # (The connector is still asked, so its view of the request stays whole.)
        computes_all = request.prompt_logprobs_pending
        if computes_all:
            hits, num_local = [], 0
        num_ext, is_async = 0, False
        if self.connector is not None:
            matched, is_async = self.connector.get_num_new_matched_tokens(request, num_local)
            if matched is None:
                return None
            num_ext = max(0, min(matched, request.num_tokens - 1 - num_local))  # one token is computed
            if computes_all:
                num_ext, is_async = 0, False
        return hits, num_local, num_ext, is_async

    def admit(self, request: Request, hits: list, num_local: int, num_ext: int) -> bool:
        """Allocate blocks for an asynchronous load and park the request until it lands.
        False when the blocks are not there (the request stays waiting)."""
        if self.kv.allocate_slots(request, 0, num_local, hits, num_ext) is None:
            return False
        assert self.connector is not None
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id), num_ext)
        request.num_computed_tokens = num_local
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[request.request_id] = num_local + num_ext
        return True

    def release_idle_blocks(self, waiting: Iterable[Request], head: Request) -> bool:
        """Free the blocks of waiting requests other than head (their loaded KV stays in the prefix
        cache where enabled). Returns whether any were freed."""
        freed = False
        for request in waiting:
            if request is not head and self.kv.get_block_ids(request.request_id):
                self.kv.free(request)
                request.num_computed_tokens = 0
                freed = True
        return freed

    # == finishing =================================================================================
    def finish(self, request: Request, was: RequestStatus) -> dict[str, Any] | None:
        """A request reached a finished status (it left every queue): ask the connector, then free
        its blocks or hold them. Returns the connector's kv_transfer_params."""
        request_id = request.request_id
        was_loading = was == RequestStatus.WAITING_FOR_REMOTE_KV
        if was_loading:
            del self.loading[request_id]
        delay_free, params = False, None
        if self.connector is not None:
            block_ids = self.kv.get_block_ids(request_id)
            try:
                delay_free, params = self.connector.request_finished(request, block_ids)
            except Exception:  # a plugin bug must not leak blocks or kill the engine
                logger.exception("KV connector request_finished failed for %s", request_id)
            delay_free = delay_free and bool(block_ids)  # nothing to hold
        if delay_free:
            self._await_sending.add(request_id)
        if was_loading:
            self._await_recving.add(request_id)  # the load may still write into its blocks
        if delay_free or was_loading:
            self.held[request_id] = request
        else:
            self.kv.free(request)
        return params

    def drop_unadmitted(self, request: Request) -> bool:
        """Tell the connector that a request it never saw admitted has finished, with no blocks
        (Scheduler.drop_unadmitted). Returns whether there was a connector to tell."""
        if self.connector is None or request.kv_transfer_params is None:
            return False
        try:
            self.connector.request_finished(request, [])
        except Exception:  # a plugin bug must not kill the engine: the hold just runs out
            logger.exception("KV connector request_finished failed for unadmitted %s", request.request_id)
        return True

    def abort_held(self, request_id: str) -> None:
        """An abort for a request that finished already, its blocks held for a hand-off nobody
        will take now."""
        if request_id not in self._await_sending or self.connector is None:
            return
        try:
            self.connector.abort_held(request_id)
        except Exception:  # a plugin bug must not kill the engine: the hold just runs out
            logger.exception("KV connector abort_held failed for %s", request_id)

    def _release_if_done(self, request_id: str) -> None:
        if (request_id in self.held and request_id not in self._await_sending
                and request_id not in self._await_recving):
            self.kv.free(self.held.pop(request_id))

    # == transfer reports ==========================================================================
    def on_recving_done(self, finished_recving: set[str], requests: dict[str, Request]) -> list[Request]:
        """Loads that landed: release finished requests' blocks, make loaded ones WAITING again.
        Returns the ready requests in admission order (the scheduler puts them first in line)."""
        if not finished_recving:
            return []
        for request_id in finished_recving & self._await_recving:
            self._await_recving.discard(request_id)
            self._release_if_done(request_id)
        ready = [requests[i] for i in self.loading if i in finished_recving]
        for request in ready:
            trace("d.ready", request.request_id)
            request.num_computed_tokens = min(self.loading.pop(request.request_id), request.num_tokens - 1)
            self.kv.cache_blocks(request, request.num_computed_tokens)  # loaded blocks are shareable now
            request.status = RequestStatus.WAITING
        return ready

    def on_sending_done(self, finished_sending: Iterable[str]) -> None:
        for request_id in finished_sending:
            self._await_sending.discard(request_id)
            self._release_if_done(request_id)

    def handle_invalid_blocks(self, bad: set[int], requests: Iterable[Request],
                              fail: Callable[[Request, str], None],
                              preempt: Callable[[Request], None]) -> None:
        """Apply the connector's failure policy to every request holding a block whose load failed."""
        policy = self.connector.failure_policy if self.connector is not None else KVTransferFailure.FAIL
        self.kv.invalidate_blocks(bad)  # nobody may hit them in the prefix cache any more
        for request in list(requests):
            block_ids = self.kv.get_block_ids(request.request_id)
            first = next((i for i, b in enumerate(block_ids) if b in bad), None)
            if first is None:
                continue
            cut = self.kv.recompute_point(request.request_id, first * self.block_size)  # window: maybe 0
            if policy == KVTransferFailure.FAIL:
                num_bad = sum(1 for b in block_ids if b in bad)
                fail(request, f"KV transfer failed for {num_bad} of {len(block_ids)} blocks of request "
                              f"{request.request_id!r} (kv failure policy 'fail')")
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self.loading[request.request_id] = min(self.loading[request.request_id], cut)
            elif request.status == RequestStatus.RUNNING:
                # Its step may have read bad KV: drop the step, keep the good prefix, recompute.
                self.kv.cache_blocks(request, min(request.num_computed_tokens, cut))
                preempt(request)
            else:  # WAITING with loaded blocks, not yet run
                request.num_computed_tokens = min(request.num_computed_tokens, cut)


__all__ = ["RemoteKV"]
