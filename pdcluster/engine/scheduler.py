"""Scheduler: decides, every step, which requests compute how many tokens (no prefill/decode phases).

Request states and the calls that move them: pdcluster/engine/request.py. KV that a connector
loads or hands off (held blocks, asynchronous loads, failed loads): remote_kv.py.

One step: schedule() -> runner.execute() -> update(). update() must follow every schedule(),
even an empty one; finish_requests() and add_request() are called between steps.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from pdcluster.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pdcluster.engine.block_pool import KVEvent
from pdcluster.engine.draft_policy import DraftPolicy
from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.kv_connector import KVConnectorBase
from pdcluster.engine.kv_window import max_step_tokens
from pdcluster.engine.ngram_proposer import NgramDrafter
from pdcluster.engine.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    RequestFault,
    SchedulerOutput,
)
from pdcluster.engine.remote_kv import RemoteKV
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.request_limits import admission_error, append_until_stop, never_fits
from pdcluster.engine.step_plan import AdmitOutcome, StepPlan

logger = logging.getLogger(__name__)


def _priority_key(req: Request) -> tuple[int, float]:
    """--scheduling-policy priority: lower priority values first, then earlier arrivals."""
    return req.sampling_params.priority, req.arrival_time


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 connector: KVConnectorBase | None = None, log_stats: bool = True,
                 enable_kv_events: bool = True, sliding_window: int | None = None,
                 speculative: SpeculativeConfig | None = None) -> None:
        self.config = scheduler_config
        self.speculative = speculative
        # How many drafts each request checks per step (None: speculation off).
        self.drafts = (DraftPolicy(speculative.num_speculative_tokens, speculative.adaptive)
                       if speculative is not None else None)
        self.drafter = (NgramDrafter(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
                        if speculative is not None else None)
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        # Blocks behind the window are freed unless a KV connector needs every block of a request
        # (a store save reads them all; the P2P hand-off sends only the window's tail).
        frees = connector is None or getattr(connector, "frees_behind_window", False)
        self.kv = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching, scheduler_config.max_model_len,
                                 enable_kv_events, sliding_window if frees else None)
        self.connector = connector
        self.log_stats = log_stats
        self.requests: dict[str, Request] = {}  # every unfinished request, whatever its state
        # fcfs: arrival order, preempted at the front; running in admission order.
        # priority: both in (priority, arrival) order, so the running tail is still the first
        # preempted and the running loop, which goes front to back, never preempts a request it
        # has scheduled this step.
        self.by_priority = scheduler_config.policy == "priority"
        self.waiting: deque[Request] = deque()  # WAITING and PREEMPTED
        self.running: list[Request] = []  # the tail is preempted first
        self.remote = RemoteKV(self.kv, connector, cache_config.block_size)  # loads and hand-offs
        self._finished_ids: set[str] = set()  # runner state to drop; sent with the next schedule()
        self._pending_outputs: list[EngineCoreOutput] = []  # errors raised outside update()
        self._num_preemptions = 0
        self._spec_counts = {"spec_decode_drafts": 0, "spec_decode_draft_tokens": 0,
                             "spec_decode_accepted_tokens": 0}
        # A connector was told of a request outside a step (drop_unadmitted): one step must run
        # so its notices (e.g. a P2P release to the producer) go out with build_connector_meta.
        self._connector_notice = False
        self._held = False  # the last step was a load-first one (kv_load_wait_s)

    # == requests in and out =======================================================================
    def add_request(self, request: Request) -> None:
        request_id = request.request_id
        if request_id in self.requests or request_id in self.remote.held:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        self.kv.update_block_hashes(request)
        error = admission_error(request, self.max_model_len, self.block_size, self.kv.num_blocks,
                                self.kv.sliding_window)
        if error is not None:  # never queued: report it with the next update()
            request.status, request.error = RequestStatus.FINISHED_ERROR, error
            self._pending_outputs.append(EngineCoreOutput(request_id, [], finish_reason="error", error=error))
            self.drop_unadmitted(request)
            return
        request.status = RequestStatus.WAITING
        self.requests[request_id] = request
        if self.by_priority:
            bisect.insort(self.waiting, request, key=_priority_key)
        else:
            self.waiting.append(request)

    def drop_unadmitted(self, request: Request) -> None:
        """A request carrying connector params that never entered the queues (refused at
        admission, or its caller went away before the engine took it): the connector hears it
        finished with no blocks, so a producer holding its KV for this decode leg lets go now
        rather than at its lease's expiry."""
        if not request.status.finished:
            request.status = RequestStatus.FINISHED_ABORTED
        if self.remote.drop_unadmitted(request):
            self._connector_notice = True

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string). Unknown or finished ids are ignored.
        No output is emitted: the caller knows. Blocks follow the connector's delay_free."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.get(request_id)
            if req is not None:
                self._finish(req, status)
            elif status == RequestStatus.FINISHED_ABORTED:
                self.remote.abort_held(request_id)

    def _finish(self, req: Request, status: RequestStatus, error: str | None = None) -> dict[str, Any] | None:
        """Move req to a finished status, out of every queue; free or hold its blocks.
        Returns the connector's kv_transfer_params."""
        was = req.status
        if was == RequestStatus.RUNNING:
            self.running.remove(req)
        elif was != RequestStatus.WAITING_FOR_REMOTE_KV:  # that one is RemoteKV's to drop
            self.waiting.remove(req)
        del self.requests[req.request_id]
        if self.drafts is not None and self.drafter is not None:
            self.drafts.forget(req.request_id)
            self.drafter.forget(req.request_id)
        req.status, req.error = status, error
        self._finished_ids.add(req.request_id)
        return self.remote.finish(req, was)

    def _fail(self, req: Request, error: str, field: str | None = None) -> None:
        """Finish a queued request with FINISHED_ERROR; its output goes out with the next update().
        field: the request field at fault (outputs.RequestFault), when the request itself is."""
        params = self._finish(req, RequestStatus.FINISHED_ERROR, error)
        self._pending_outputs.append(EngineCoreOutput(
            req.request_id, [], finish_reason="error", error=error, error_field=field, kv_transfer_params=params,
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
        if self.by_priority:  # behind the waiting requests that outrank it
            bisect.insort(self.waiting, req, key=_priority_key)
        else:
            self.waiting.appendleft(req)
        self._finished_ids.add(req.request_id)

    # == schedule ==================================================================================
    def schedule(self) -> SchedulerOutput:
        step = StepPlan(budget=self.config.max_num_batched_tokens)
        if self._loads_first():
            # Only the loads start this step; the running requests wait for them (the engine
            # holds their step up to kv_load_wait_s), then run with the loaded ones.
            self._schedule_waiting(step, loads_only=True)
            if step.loads:
                self._held = True
                out = self._output(step)
                out.load_first = step.loads
                return out
        self._held = False
        self._schedule_running(step)
        self._add_drafts(step)
        if not step.preempted:  # blocks are short: admitting more would only preempt again
            self._schedule_waiting(step)
        return self._output(step)

    def schedule_idle(self) -> SchedulerOutput:
        """A step that computes nothing: the runner drops finished requests' state and reports
        the transfers that ended (how the engine collects the loads a load-first step waits for)."""
        return self._output(StepPlan(budget=0))

    def _loads_first(self) -> bool:
        """Whether this step only starts loads: kv_load_wait_s is on, requests run (and ran in the
        last step: one hold per step of theirs, so a stream of hand-offs never starves them), and
        the head of the queue is a decode leg whose KV a connector loads (checked at admission)."""
        if (self.config.kv_load_wait_s <= 0 or self._held or not self.running or not self.waiting
                or self.connector is None):
            return False
        head = self.waiting[0]
        kv = head.kv_transfer_params
        return (kv is not None and kv.do_remote_prefill and head.request_id not in self._finished_ids
                and not self.kv.get_block_ids(head.request_id))

    def loading_any(self, request_ids: Iterable[str]) -> bool:
        """Whether a load of any of these requests is still in flight."""
        return any(request_id in self.remote.loading for request_id in request_ids)

    def _output(self, step: StepPlan) -> SchedulerOutput:
        finished, self._finished_ids = self._finished_ids, set()
        out = SchedulerOutput(step.new_reqs, step.cached_reqs, step.num_scheduled,
                              sum(step.num_scheduled.values()), finished)
        out.scheduled_spec_token_ids = step.spec_token_ids
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self._connector_notice = False
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
        num_new = min(remaining, budget)
        cap = self.config.long_prefill_token_threshold
        if 0 < cap < num_new:  # a prompt chunk (a decode computes 1; drafts are added after)
            num_new = cap
        window = self.kv.sliding_window
        if window is not None:  # blocks behind the window are freed: a chunk is what must fit
            # (at least 1: a pool too small even for that is refused by never_fits, not skipped)
            fits = max(1, max_step_tokens(num_computed, window, self.block_size, self.kv.num_blocks))
            num_new = min(num_new, fits)
        return num_new

    def _never_fits(self, num_computed: int, num_new: int) -> str | None:
        return never_fits(num_computed + num_new, self.block_size, self.kv.num_blocks, self.kv.sliding_window,
                          num_computed)

    def _schedule_running(self, step: StepPlan) -> None:
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            num_new = self._chunk(req, req.num_computed_tokens, step.budget)
            if num_new <= 0:
                i += 1
                continue
            error = self._never_fits(req.num_computed_tokens, num_new)
            if error is not None:
                self._fail(req, error)
                continue  # removed from running: index i now holds the next request
            block_ids = self._allocate_or_preempt(req, num_new, step)
            if block_ids is None:
                return  # req preempted itself: everything after it is gone too
            step.cached_reqs.append(CachedRequestData(req.request_id, block_ids, req.num_computed_tokens))
            step.add(req, num_new)
            if (drafts := self._propose(req, num_new, step.budget)):
                step.proposals.append((req, drafts, step.cached_reqs[-1]))
            i += 1

    def _propose(self, req: Request, num_new: int, budget: int) -> list[int]:
        """Drafts req could check after its token this step: none when speculation is off, it is
        not a decode, there is no room (budget, max_tokens, max_model_len, a sliding window's step
        bound), no n-gram matched, or SpeculativeConfig.disable_by_batch_size requests run.
        A request under a grammar gets them too: its rows are masked in the matcher's state after
        the drafts before them, which is rolled back after (structured_output.apply_grammar_masks)."""
        spec = self.speculative
        if (spec is None or num_new != 1 or req.num_computed_tokens != req.num_tokens - 1
                or (spec.disable_by_batch_size is not None and len(self.running) >= spec.disable_by_batch_size)):
            return []
        room = min(spec.num_speculative_tokens, budget, self.max_model_len - req.num_tokens,
                   req.sampling_params.max_tokens - req.num_output_tokens - 1)
        if self.kv.sliding_window is not None:
            room = min(room, max_step_tokens(req.num_computed_tokens, self.kv.sliding_window, self.block_size,
                                             self.kv.num_blocks) - 1)
        if room < 1:
            return []
        assert self.drafter is not None
        return self.drafter.propose(req.request_id, req.prompt_token_ids, req.output_token_ids, room)

    def _add_drafts(self, step: StepPlan) -> None:
        """The drafts the policy (draft_policy.py) finds worth checking, after the running
        requests' tokens: blocks for them if free ones suffice (never preempting for a guess)."""
        if not step.proposals:
            return
        rows = sum(1 for n in step.num_scheduled.values() if n == 1)  # decode rows so far
        plan = self.drafts.plan(rows, [(req.request_id, len(d)) for req, d, _ in step.proposals])
        for req, drafts, cached in step.proposals:
            k = min(plan.get(req.request_id, 0), step.budget)
            if k < 1:
                continue
            block_ids = self.kv.allocate_slots(req, 1 + k)  # on top of the token's own slot
            if block_ids is None:
                continue
            cached.new_block_ids.extend(block_ids)
            step.add(req, 1 + k)  # replaces its count of 1
            step.spec_token_ids[req.request_id] = drafts[:k]
            self._spec_counts["spec_decode_drafts"] += 1
            self._spec_counts["spec_decode_draft_tokens"] += k

    def record_step_time(self, out: SchedulerOutput, seconds: float) -> None:
        """EngineCore's time for the runner's step: a decode-shaped one (one row per token) feeds
        the draft policy's cost of rows."""
        if self.drafts is None or out.is_empty:
            return
        spec = out.scheduled_spec_token_ids
        if all(n == 1 or rid in spec for rid, n in out.num_scheduled_tokens.items()):
            self.drafts.record_step(out.total_num_scheduled_tokens, seconds)

    def _allocate_or_preempt(self, req: Request, num_new: int, step: StepPlan) -> list[int] | None:
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

    def _schedule_waiting(self, step: StepPlan, loads_only: bool = False) -> None:
        """Admit waiting requests in order. loads_only: only those whose KV a connector loads
        asynchronously, stopping at the first other one (a load-first step computes nothing)."""
        skipped: list[Request] = []
        retried = False
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if req.request_id in self._finished_ids:
                skipped.append(req)  # the runner drops its old state this step; admit it next step
                continue
            try:
                outcome = self._admit(req, step, loads_only)
            except Exception as e:  # a connector plugin raised: fail this request, not the engine
                logger.exception("admitting %s failed", req.request_id)
                self.waiting.appendleft(req)  # not yet RUNNING: _finish finds it in the queue
                self._fail(req, f"KV connector error while scheduling: {type(e).__name__}: {e}")
                continue
            if outcome == AdmitOutcome.SKIP:
                skipped.append(req)
            elif outcome == AdmitOutcome.BLOCKED:
                self.waiting.appendleft(req)
                # Nothing running will ever free blocks: take them back from idle loaded requests.
                if self.running or retried or not self.remote.release_idle_blocks(self.waiting, req):
                    break
                retried = True
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, req: Request, step: StepPlan, loads_only: bool = False) -> AdmitOutcome:
        held = bool(self.kv.get_block_ids(req.request_id))  # loaded by a connector, not yet run
        if (match := self.remote.match(req, held)) is None:  # the connector cannot tell yet
            return AdmitOutcome.SKIP
        hits, num_local, num_ext, is_async = match
        if is_async and num_ext > 0:
            admitted = self.remote.admit(req, hits, num_local, num_ext)
            if admitted:
                step.loads.append(req.request_id)
            return AdmitOutcome.REMOTE if admitted else AdmitOutcome.BLOCKED
        if loads_only:
            return AdmitOutcome.BLOCKED  # it computes: the next (normal) step admits it
        num_computed = (req.num_computed_tokens if held else num_local) + num_ext
        num_new = self._chunk(req, num_computed, step.budget)
        if num_new <= 0:
            return AdmitOutcome.BLOCKED
        error = self._never_fits(num_computed, num_new)
        if error is not None:
            self.waiting.appendleft(req)  # _finish takes it out of its queue
            self._fail(req, error)
            return AdmitOutcome.DROPPED
        if self.kv.allocate_slots(req, num_new, num_local, hits, num_ext) is None:
            return AdmitOutcome.BLOCKED
        block_ids = self.kv.get_block_ids(req.request_id)
        if self.connector is not None:
            self.connector.update_state_after_alloc(req, block_ids, num_ext)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
        if self.by_priority:  # after the running loop: inserting mid-list disturbs nothing
            bisect.insort(self.running, req, key=_priority_key)
        else:
            self.running.append(req)
        step.new_reqs.append(NewRequestData(
            req.request_id, req.prompt_token_ids, list(req.output_token_ids), req.sampling_params,
            block_ids, num_computed, req.eos_token_ids, req.mm_features))
        step.add(req, num_new)
        return AdmitOutcome.ADMITTED

    # == update ====================================================================================
    def update(self, scheduler_output: SchedulerOutput,
               runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply one step's results; return the per-request deltas (errors raised since included)."""
        if runner_output.invalid_block_ids:
            self.remote.handle_invalid_blocks(runner_output.invalid_block_ids, self.requests.values(),
                                              self._fail, self._preempt)
        index = {request_id: i for i, request_id in enumerate(runner_output.request_ids)}
        for request_id in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or preempted since schedule(): its results are void
            i = index.get(request_id)
            fault = runner_output.faults.get(request_id)
            if fault is not None:  # its own masks left it no token: it ends here, with the error
                logprobs = runner_output.logprobs[i] if i is not None and i < len(runner_output.logprobs) else []
                self._end_on_fault(req, runner_output.sampled_token_ids[i] if i is not None else [], logprobs, fault)
                continue
            drafts = scheduler_output.scheduled_spec_token_ids.get(request_id)
            if drafts and i is not None:  # the rejected drafts' KV is not the request's: roll back
                num_accepted = len(runner_output.sampled_token_ids[i]) - 1
                req.num_computed_tokens -= len(drafts) - num_accepted
                self._spec_counts["spec_decode_accepted_tokens"] += num_accepted
                self.drafts.record_check(request_id, len(drafts), num_accepted)
            # Publish blocks first: a request finishing now leaves its prefix in the cache.
            self.kv.cache_blocks(req, req.num_computed_tokens)
            scored = runner_output.prompt_logprobs.get(request_id)
            if scored is not None:
                req.add_prompt_logprobs(*scored)
            if i is None or req.num_computed_tokens < req.num_tokens:
                continue  # a prompt chunk short of the last token samples nothing
            logprobs = runner_output.logprobs[i] if i < len(runner_output.logprobs) else []
            out = self._append_tokens(req, runner_output.sampled_token_ids[i], logprobs)
            if out is not None:
                self._pending_outputs.append(out)
        # Loaded requests hold blocks already: first in line, in admission order.
        self.waiting.extendleft(reversed(self.remote.on_recving_done(runner_output.finished_recving,
                                                                     self.requests)))
        self.remote.on_sending_done(runner_output.finished_sending)
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _end_on_fault(self, req: Request, token_ids: list[int], logprobs: list[Any], fault: RequestFault) -> None:
        """The runner found a row of req's step that its own masks left with no token: the
        tokens before that row (drafts it kept) are its last, then it fails naming the field,
        unless those tokens stopped it first."""
        out = self._append_tokens(req, token_ids, logprobs) if token_ids else None
        if out is not None:
            self._pending_outputs.append(out)
            if out.finish_reason is not None:
                return
        self._fail(req, fault.message, fault.field)

    def _append_tokens(self, req: Request, token_ids: list[int], logprobs: list[Any]) -> EngineCoreOutput | None:
        new, status = append_until_stop(req, token_ids, self.max_model_len)
        if not new:
            return None
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        out = EngineCoreOutput(req.request_id, new, list(logprobs[:len(new)]),
                               prompt_logprobs=req.take_prompt_logprobs(),
                               num_cached_tokens=max(0, req.num_cached_tokens))
        if status is not None:
            out.kv_transfer_params = self._finish(req, status)
            out.finish_reason, out.stop_reason = status.finish_reason, req.stop_reason
        return out

    # == introspection =============================================================================
    def has_unfinished_requests(self) -> bool:
        """Whether the engine must keep stepping: unfinished requests, outputs or runner drops not
        yet delivered, blocks held until a connector reports a transfer done, or connector
        notices not yet sent."""
        return bool(self.requests or self._pending_outputs or self._finished_ids or self.remote.held
                    or self._connector_notice)

    def only_waiting(self) -> bool:
        """Asked after a step that scheduled nothing: unfinished work is left (requests waiting for
        a transfer or for blocks one holds, holds of their own) and nothing to deliver (outputs,
        runner drops, connector notices), so only a transfer ending or a new command can give the
        next step something to do. The engine then waits for that instead of stepping at once."""
        return self.has_unfinished_requests() and not (self._pending_outputs or self._finished_ids
                                                       or self._connector_notice)

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
            "num_waiting_for_remote_kv": len(self.remote.loading),
            "num_held_for_transfer": len(self.remote.held),
        }
        if not self.log_stats:
            return stats
        stats["num_preemptions"] = self._num_preemptions
        if self.speculative is not None:
            stats.update(self._spec_counts)
        stats.update(self.kv.make_stats().as_stats())
        return stats


__all__ = ["Scheduler"]
