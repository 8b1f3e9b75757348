"""Scheduler: decides, every step, which requests compute how many tokens (no prefill/decode phases).

Request states (RequestStatus) and the calls that move them:

                      schedule(): the connector matches tokens asynchronously
                 +--------------------------------------------------------+
                 |                                                        v
  add_request -> WAITING <--- update(): finished_recving ---- WAITING_FOR_REMOTE_KV
                 |  ^          (num_computed = loaded tokens)   (blocks allocated; never scheduled)
      schedule():|  | PREEMPTED: back at the FRONT of the waiting queue; re-admitted with
      admitted   |  | prefix hits, it resumes as a NewRequestData carrying its output tokens
                 v  |
              RUNNING   schedule(): out of blocks -> the newest running request is PREEMPTED
                 |      (its blocks freed, num_computed_tokens = 0: recompute); update() does the
                 |      same to one whose loaded blocks failed under policy "recompute"
                 v
              FINISHED_STOPPED   eos (unless ignore_eos) or stop_token_ids, once min_tokens reached
              FINISHED_LENGTH    max_tokens or max_model_len
              FINISHED_ABORTED   finish_requests(), from any unfinished state
              FINISHED_ERROR     can never fit the cache, or KV transfer failed under policy "fail"

Blocks are freed when a request finishes, except: the connector's request_finished said
delay_free (freed when finished_sending reports it), or a load was still in flight (freed when
finished_recving reports it).

One step: schedule() -> runner.execute() -> update(). update() must follow every schedule(),
even an empty one; finish_requests() and add_request() are called between steps.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pdcluster.config import CacheConfig, SchedulerConfig
from pdcluster.engine.block_pool import KVEvent
from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.kv_connector import KVConnectorBase, KVTransferFailure
from pdcluster.engine.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pdcluster.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# Outcomes of trying to admit one waiting request.
_ADMITTED, _REMOTE, _SKIP, _BLOCKED, _DROPPED = range(5)


@dataclass
class _Step:
    """What one schedule() call has decided so far."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    scheduled: list[Request] = field(default_factory=list)
    preempted: bool = False

    def add(self, req: Request, num_tokens: int) -> None:
        self.num_scheduled[req.request_id] = num_tokens
        self.scheduled.append(req)
        self.budget -= num_tokens


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 connector: KVConnectorBase | None = None, log_stats: bool = True,
                 enable_kv_events: bool = True) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.kv = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching, scheduler_config.max_model_len,
                                 enable_kv_events)
        self.connector = connector
        self.log_stats = log_stats
        self.requests: dict[str, Request] = {}  # every unfinished request, whatever its state
        self.waiting: deque[Request] = deque()  # WAITING and PREEMPTED, FCFS; preempted at the front
        self.running: list[Request] = []  # admission order: the tail is preempted first
        self.remote_kv: dict[str, int] = {}  # WAITING_FOR_REMOTE_KV id -> num_computed once loaded
        # Finished requests whose blocks a connector still uses, and what each one waits for.
        self.held: dict[str, Request] = {}
        self._await_sending: set[str] = set()
        self._await_recving: set[str] = set()
        self._finished_ids: set[str] = set()  # runner state to drop; sent with the next schedule()
        self._pending_outputs: list[EngineCoreOutput] = []  # errors raised outside update()
        self._num_preemptions = 0

    # == requests in and out =======================================================================
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests or rid in self.held:
            raise ValueError(f"request_id {rid!r} is already in flight")
        self.kv.update_block_hashes(request)
        error = self._admission_error(request)
        if error is not None:  # never queued: report it with the next update()
            request.status, request.error = RequestStatus.FINISHED_ERROR, error
            self._pending_outputs.append(EngineCoreOutput(rid, [], finish_reason="error", error=error))
            return
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.append(request)

    def _admission_error(self, request: Request) -> str | None:
        n = request.num_prompt_tokens
        if n == 0:
            return "prompt is empty"
        if n > self.max_model_len:
            return f"prompt is {n} tokens, more than max_model_len={self.max_model_len}"
        return self._never_fits(n)

    def _never_fits(self, num_tokens: int) -> str | None:
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks <= self.kv.num_blocks:
            return None
        return (f"request needs {num_blocks} KV blocks for {num_tokens} tokens but the cache holds only "
                f"{self.kv.num_blocks} blocks of {self.block_size} tokens")

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string). Unknown or finished ids are ignored.
        No output is emitted: the caller knows. Blocks follow the connector's delay_free."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, status)
            elif (status == RequestStatus.FINISHED_ABORTED and rid in self._await_sending
                  and self.connector is not None):
                # Finished already, its blocks held for a hand-off nobody will take now.
                try:
                    self.connector.abort_held(rid)
                except Exception:  # a plugin bug must not kill the engine: the hold just runs out
                    logger.exception("KV connector abort_held failed for %s", rid)

    def _finish(self, req: Request, status: RequestStatus, error: str | None = None) -> dict[str, Any] | None:
        """Move req to a finished status, out of every queue; free or hold its blocks.
        Returns the connector's kv_transfer_params."""
        rid, was = req.request_id, req.status
        if was == RequestStatus.RUNNING:
            self.running.remove(req)
        elif was == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.remote_kv[rid]
        else:
            self.waiting.remove(req)
        del self.requests[rid]
        req.status, req.error = status, error
        self._finished_ids.add(rid)
        delay_free, params = False, None
        if self.connector is not None:
            block_ids = self.kv.get_block_ids(rid)
            try:
                delay_free, params = self.connector.request_finished(req, block_ids)
            except Exception:  # a plugin bug must not leak blocks or kill the engine
                logger.exception("KV connector request_finished failed for %s", rid)
            delay_free = delay_free and bool(block_ids)  # nothing to hold
        if delay_free:
            self._await_sending.add(rid)
        if was == RequestStatus.WAITING_FOR_REMOTE_KV:
            self._await_recving.add(rid)  # the load may still write into its blocks
        if delay_free or was == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.held[rid] = req
        else:
            self.kv.free(req)
        return params

    def _release_if_done(self, rid: str) -> None:
        if rid in self.held and rid not in self._await_sending and rid not in self._await_recving:
            self.kv.free(self.held.pop(rid))

    def _fail(self, req: Request, error: str) -> None:
        """Finish a queued request with FINISHED_ERROR; its output goes out with the next update()."""
        params = self._finish(req, RequestStatus.FINISHED_ERROR, error)
        self._pending_outputs.append(EngineCoreOutput(
            req.request_id, [], finish_reason="error", error=error, kv_transfer_params=params,
            num_cached_tokens=max(0, req.num_cached_tokens)))

    def _preempt(self, req: Request) -> None:
        """Recompute later: drop its blocks (published ones stay hittable in the prefix cache)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(req)
        self._finished_ids.add(req.request_id)

    # == schedule ==================================================================================
    def schedule(self) -> SchedulerOutput:
        step = _Step(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:  # blocks are short: admitting more would only preempt again
            self._schedule_waiting(step)
        finished, self._finished_ids = self._finished_ids, set()
        out = SchedulerOutput(step.new_reqs, step.cached_reqs, step.num_scheduled,
                              sum(step.num_scheduled.values()), finished)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        # The runner computes these tokens now; update() sees num_computed_tokens after the step.
        for req in step.scheduled:
            req.num_computed_tokens += step.num_scheduled[req.request_id]
        return out

    def _chunk(self, req: Request, num_computed: int, budget: int) -> int:
        """Tokens req may compute this step: 0 when it must wait for a larger budget."""
        remaining = req.num_tokens - num_computed
        if (not self.config.enable_chunked_prefill and remaining > budget
                and remaining <= self.config.max_num_batched_tokens):
            return 0  # without chunking a prompt waits until it fits whole (unless it never can)
        return min(remaining, budget)

    def _schedule_running(self, step: _Step) -> None:
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            num_new = self._chunk(req, req.num_computed_tokens, step.budget)
            if num_new <= 0:
                i += 1
                continue
            error = self._never_fits(req.num_computed_tokens + num_new)
            if error is not None:
                self._fail(req, error)
                continue  # removed from running: index i now holds the next request
            block_ids = self._allocate_or_preempt(req, num_new, step)
            if block_ids is None:
                return  # req preempted itself: everything after it is gone too
            step.cached_reqs.append(CachedRequestData(req.request_id, block_ids, req.num_computed_tokens))
            step.add(req, num_new)
            i += 1

    def _allocate_or_preempt(self, req: Request, num_new: int, step: _Step) -> list[int] | None:
        """Allocate, preempting the most recently admitted running requests until it fits."""
        while True:
            block_ids = self.kv.allocate_slots(req, num_new)
            if block_ids is not None:
                return block_ids
            victim = self.running[-1]  # never one scheduled this step: those are before req
            self._preempt(victim)
            step.preempted = True
            if victim is req:
                return None

    def _schedule_waiting(self, step: _Step) -> None:
        skipped: list[Request] = []
        retried = False
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if req.request_id in self._finished_ids:
                skipped.append(req)  # the runner drops its old state this step; admit it next step
                continue
            try:
                outcome = self._admit(req, step)
            except Exception as e:  # a connector plugin raised: fail this request, not the engine
                logger.exception("admitting %s failed", req.request_id)
                self.waiting.appendleft(req)  # not yet RUNNING: _finish finds it in the queue
                self._fail(req, f"KV connector error while scheduling: {type(e).__name__}: {e}")
                continue
            if outcome == _SKIP:
                skipped.append(req)
            elif outcome == _BLOCKED:
                self.waiting.appendleft(req)
                # Nothing running will ever free blocks: take them back from idle loaded requests.
                if self.running or retried or not self._release_idle_blocks(req):
                    break
                retried = True
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, req: Request, step: _Step) -> int:
        held = bool(self.kv.get_block_ids(req.request_id))  # loaded by a connector, not yet run
        hits, num_local, num_ext, is_async = [], 0, 0, False
        if not held:
            hits, num_local = self.kv.get_computed_blocks(req)
            if self.connector is not None:
                matched, is_async = self.connector.get_num_new_matched_tokens(req, num_local)
                if matched is None:
                    return _SKIP
                num_ext = max(0, min(matched, req.num_tokens - 1 - num_local))  # one token is computed
        if is_async and num_ext > 0:
            return self._admit_remote(req, hits, num_local, num_ext)
        num_computed = (req.num_computed_tokens if held else num_local) + num_ext
        num_new = self._chunk(req, num_computed, step.budget)
        if num_new <= 0:
            return _BLOCKED
        error = self._never_fits(num_computed + num_new)
        if error is not None:
            self.waiting.appendleft(req)  # _finish takes it out of its queue
            self._fail(req, error)
            return _DROPPED
        if self.kv.allocate_slots(req, num_new, num_local, hits, num_ext) is None:
            return _BLOCKED
        block_ids = self.kv.get_block_ids(req.request_id)
        if self.connector is not None:
            self.connector.update_state_after_alloc(req, block_ids, num_ext)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
        self.running.append(req)
        step.new_reqs.append(NewRequestData(
            req.request_id, req.prompt_token_ids, list(req.output_token_ids), req.sampling_params,
            block_ids, num_computed, req.eos_token_ids))
        step.add(req, num_new)
        return _ADMITTED

    def _admit_remote(self, req: Request, hits: list, num_local: int, num_ext: int) -> int:
        if self.kv.allocate_slots(req, 0, num_local, hits, num_ext) is None:
            return _BLOCKED
        assert self.connector is not None
        self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), num_ext)
        req.num_computed_tokens = num_local
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote_kv[req.request_id] = num_local + num_ext
        return _REMOTE

    def _release_idle_blocks(self, head: Request) -> bool:
        """Free the blocks of waiting requests other than head (their loaded KV stays in the prefix
        cache where enabled). Returns whether any were freed."""
        freed = False
        for req in self.waiting:
            if req is not head and self.kv.get_block_ids(req.request_id):
                self.kv.free(req)
                req.num_computed_tokens = 0
                freed = True
        return freed

    # == update ====================================================================================
    def update(self, scheduler_output: SchedulerOutput,
               model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply one step's results; return the per-request deltas (errors raised since included)."""
        mro = model_runner_output
        if mro.invalid_block_ids:
            self._handle_invalid_blocks(mro.invalid_block_ids)
        index = {rid: i for i, rid in enumerate(mro.req_ids)}
        for rid in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or preempted since schedule(): its results are void
            # Publish blocks first: a request finishing now leaves its prefix in the cache.
            self.kv.cache_blocks(req, req.num_computed_tokens)
            i = index.get(rid)
            if i is None or req.num_computed_tokens < req.num_tokens:
                continue  # a prompt chunk short of the last token samples nothing
            lp = mro.logprobs[i] if i < len(mro.logprobs) else None
            out = self._append_tokens(req, mro.sampled_token_ids[i], lp)
            if out is not None:
                self._pending_outputs.append(out)
        self._on_recving_done(mro.finished_recving)
        for rid in mro.finished_sending:
            self._await_sending.discard(rid)
            self._release_if_done(rid)
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _append_tokens(self, req: Request, token_ids: list[int], logprob: Any) -> EngineCoreOutput | None:
        new: list[int] = []
        status = None
        for t in token_ids:
            req.append_output_token(t)
            new.append(t)
            status = self._check_stop(req)
            if status is not None:
                break  # tokens sampled past a stop are dropped
        if not new:
            return None
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        out = EngineCoreOutput(req.request_id, new, [logprob] if logprob is not None else [],
                               num_cached_tokens=max(0, req.num_cached_tokens))
        if status is not None:
            out.kv_transfer_params = self._finish(req, status)
            out.finish_reason, out.stop_reason = status.finish_reason, req.stop_reason
        return out

    def _check_stop(self, req: Request) -> RequestStatus | None:
        """Token-level stops after appending a token. A stop token wins over a length limit hit by
        the same token (the model did stop there); neither stop kind fires before min_tokens."""
        sp = req.sampling_params
        last = req.output_token_ids[-1]
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and last in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                req.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _on_recving_done(self, finished_recving: set[str]) -> None:
        if not finished_recving:
            return
        for rid in finished_recving & self._await_recving:
            self._await_recving.discard(rid)
            self._release_if_done(rid)
        ready = [rid for rid in self.remote_kv if rid in finished_recving]  # admission order
        for rid in ready:
            req = self.requests[rid]
            req.num_computed_tokens = min(self.remote_kv.pop(rid), req.num_tokens - 1)
            self.kv.cache_blocks(req, req.num_computed_tokens)  # loaded blocks become shareable now
            req.status = RequestStatus.WAITING
        # They hold blocks already: first in line, in admission order.
        self.waiting.extendleft(self.requests[rid] for rid in reversed(ready))

    def _handle_invalid_blocks(self, bad: set[int]) -> None:
        """Apply the connector's failure policy to every request holding a block whose load failed."""
        policy = self.connector.failure_policy if self.connector is not None else KVTransferFailure.FAIL
        self.kv.invalidate_blocks(bad)  # nobody may hit them in the prefix cache any more
        for req in list(self.requests.values()):
            block_ids = self.kv.get_block_ids(req.request_id)
            first = next((i for i, b in enumerate(block_ids) if b in bad), None)
            if first is None:
                continue
            cut = first * self.block_size
            if policy == KVTransferFailure.FAIL:
                num_bad = sum(1 for b in block_ids if b in bad)
                error = (f"KV transfer failed for {num_bad} of {len(block_ids)} blocks of request "
                         f"{req.request_id!r} (kv failure policy 'fail')")
                self._fail(req, error)
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self.remote_kv[req.request_id] = min(self.remote_kv[req.request_id], cut)
            elif req.status == RequestStatus.RUNNING:
                # Its step may have read bad KV: drop the step, keep the good prefix, recompute.
                self.kv.cache_blocks(req, min(req.num_computed_tokens, cut))
                self._preempt(req)
            else:  # WAITING with loaded blocks, not yet run
                req.num_computed_tokens = min(req.num_computed_tokens, cut)

    # == introspection =============================================================================
    def has_unfinished_requests(self) -> bool:
        """Whether the engine must keep stepping: unfinished requests, outputs or runner drops not
        yet delivered, or blocks held until a connector reports a transfer done."""
        return bool(self.requests or self._pending_outputs or self._finished_ids or self.held)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def take_kv_events(self) -> list[KVEvent]:
        events = self.kv.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        return events

    def get_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_waiting_for_remote_kv": len(self.remote_kv),
            "num_held_for_transfer": len(self.held),
        }
        if not self.log_stats:
            return stats
        kv = self.kv.make_stats()
        stats.update(
            num_preemptions=self._num_preemptions,
            kv_cache_usage=kv.usage,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_free=kv.num_free_blocks,
            kv_blocks_cached=kv.num_cached_blocks,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            prefix_cache_hit_rate=kv.prefix_hit_rate,
            external_prefix_hits=kv.external_hits,
        )
        return stats


__all__ = ["Scheduler"]
