"""Orchestrator: one client request's life in the router, the same for the gRPC and HTTP frontends.

    open_request(prep)   admission control (bounded in-flight) and a unique request id
    stream(state)        choose the flow, run its legs, yield worker deltas to the frontend
      multimodal:        first the encoder stage (ec_stage.py): Encode on an encode worker and/or
                         EC params other workers hold for the same images, carried by every leg
      aggregated:        one leg on a `both` (or decode) worker
      disaggregated:     prefill leg (max_tokens=1, do_remote_decode) on a prefill worker, then a
                         decode leg with the kv_transfer_params it returned (DESIGN.md section 3);
                         chosen when both pools are up, unless disagg_rule.py sends the prompt to a
                         decode worker (uncached part short, or the prefill pool backlogged)
      concurrent:        (disagg_mode="concurrent") both legs at once, the params handed to the
                         admitted decode leg by Worker.ProvideKVParams (concurrent_disagg.py)
    finally              a request that did not finish cleanly (client cancel, deadline, error)
                         is aborted on every worker it touched

Retries: a leg that fails with a worker-side error (UNAVAILABLE, connection lost, INTERNAL, the
worker full) moves to another worker -- only while nothing has been yielded to the client. After
the first delta a retry would duplicate output: the request migrates instead (migration.py:
another worker continues after exactly the tokens sent), at most max_migrations times; then, or
with max_migrations=0, the stream ends with finish_reason ERROR.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.handoff_trace import trace

from . import concurrent_disagg, disagg_rule
from .config import RouterConfig
from .convert import error_response
from .ec_stage import EcStage
from .errors import RouterError
from .legs import LegRunner, check_prefill, continuation_params, first_delta
from .metrics import RouterMetrics
from .migration import Migrator, StallWatch
from .policies import RouteRequest, RoutingPolicy
from .preprocess import PreparedRequest
from .registry import WorkerRegistry
from .request_state import RequestState

log = logging.getLogger(__name__)

AGGREGATED_ROLES = ("both", "decode")  # a decode worker can always prefill locally
_ABORT_TIMEOUT_S = 5.0
_ABORT_GRACE_S = 2.0


class Orchestrator:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, policy: RoutingPolicy,
                 metrics: RouterMetrics) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.legs = LegRunner(config, registry, policy, metrics)
        self.migrator = Migrator(config, registry, self.legs, metrics)
        self.ec = EcStage(config, registry, metrics)
        self.disagg_rule = disagg_rule.DisaggRule(config.disagg_min_uncached_tokens,
                                                  config.disagg_max_prefill_backlog_tokens,
                                                  config.disagg_max_decode_inflight)
        self._running: dict[str, RequestState] = {}
        self._background: set[asyncio.Task] = set()
        self.stall_watch = StallWatch(config.stall_timeout_s, self._running)
        # Read at scrape time: two locked gauge updates less per request.
        metrics.inflight.set_function(lambda: len(self._running))

    @property
    def num_inflight(self) -> int:
        return len(self._running)

    # -- admission ------------------------------------------------------------------------------
    def open_request(self, prep: PreparedRequest, frontend: str) -> RequestState:
        if len(self._running) >= self.config.max_inflight:
            self.metrics.rejected.inc()
            err = RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"router is at its limit of {self.config.max_inflight} requests in flight; retry later")
            self.count_refused(frontend, err)
            raise err
        if prep.request_id in self._running:
            err = RouterError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request_id {prep.request_id!r} is already running", "request_id")
            self.count_refused(frontend, err)
            raise err
        state = RequestState(prep, frontend)
        self._running[prep.request_id] = state
        return state

    def count_refused(self, frontend: str, err: RouterError) -> None:
        """Count a request refused before it ran (validation, admission)."""
        self.metrics.count_request(frontend, err.code.name)

    # -- the flow -------------------------------------------------------------------------------
    async def stream(self, state: RequestState) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        """Worker deltas for the client. Raises RouterError only before the first delta; after it,
        failures arrive as a final delta with finish_reason ERROR."""
        self.stall_watch.ensure_started()
        flow = self._disagg_flow(state) if self._use_disaggregation(state) else self._aggregated(state)
        try:
            done = False
            while True:
                try:
                    async for resp in flow:
                        if done:
                            continue  # nothing may follow a final delta; the flow ends on its own
                        self._observe(state, resp)
                        state.sent_to_client = True
                        if resp.finished:
                            # Settled before the yield: a frontend may stop reading right after it.
                            done = True
                            failed = resp.finish_reason == common_pb2.FINISH_REASON_ERROR
                            state.finished_cleanly = not failed
                            state.status = ("OK" if not failed else
                                            "INVALID_ARGUMENT" if resp.error_field else "INTERNAL")
                        yield resp
                    break
                except RouterError as err:
                    if done or not self.migrator.applies(state, err):
                        raise
                    await flow.aclose()
                    flow = self.migrator.resume(state, err)  # or RouterError: the request ends
            # The flow is exhausted rather than abandoned (an abandoned async generator costs a
            # finalizer task per request).
            if not done:
                raise RouterError(grpc.StatusCode.INTERNAL, "worker stream ended without a final response")
        except RouterError as err:
            state.status = err.code.name
            if not state.sent_to_client:
                raise
            yield error_response(state.request_id, err)
        except asyncio.CancelledError:
            if state.aborted and _not_cancelling():
                # Router.Abort cancelled the worker call; the client gets a clean ABORT ending.
                state.status = "ABORTED"
                yield worker_pb2.WorkerGenerateResponse(request_id=state.request_id, finished=True,
                                                        finish_reason=common_pb2.FINISH_REASON_ABORT)
                return
            state.status = "CANCELLED"
            raise
        except GeneratorExit:  # the frontend stopped reading (client went away)
            if not state.finished_cleanly:
                state.status = "CANCELLED"
            raise
        finally:
            # Close the flow now (its finally cancels the worker call), not whenever it is
            # garbage-collected; then settle the request.
            await flow.aclose()
            self._close(state)

    def _aggregated(self, state: RequestState) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        prep = state.prep
        wreq = worker_pb2.WorkerGenerateRequest(request_id=prep.request_id, prompt_token_ids=prep.prompt_token_ids,
                                                sampling_params=prep.sampling_params, stream=prep.stream,
                                                images=prep.images)
        self.metrics.aggregated.inc()
        if prep.images:
            return self._aggregated_mm(state, wreq)
        return self.legs.run(state, AGGREGATED_ROLES, wreq, leg="decode")  # no wrapper: one layer less per delta

    async def _aggregated_mm(self, state: RequestState,
                             wreq: worker_pb2.WorkerGenerateRequest) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        await self.ec.prepare(state)
        self.ec.attach(state, wreq)
        async for resp in self.legs.run(state, AGGREGATED_ROLES, wreq, leg="decode"):
            if resp.finished:
                self.ec.record_leg(state, "decode", resp)
            yield resp

    def _use_disaggregation(self, state: RequestState) -> bool:
        prefill = self.registry.candidates(("prefill",))
        decode = self.registry.candidates(("decode",))
        if not prefill or not decode:
            return False
        rule = self.disagg_rule
        uncached = len(state.prep.prompt_token_ids)
        if rule.min_uncached_tokens > 0:
            uncached -= self._best_cached_tokens(state)
        choice = rule.choose(uncached, [h.prefill_backlog for h in prefill], [h.prefill_backlog for h in decode],
                             [h.num_inflight for h in decode])
        if choice != disagg_rule.REMOTE:
            self.metrics.decode_prefills.labels(choice).inc()
            return False
        return True

    def _best_cached_tokens(self, state: RequestState) -> int:
        hashes = self.legs.block_hashes(state)  # None unless the policy routes by cached prefix
        if not hashes:
            return 0
        views = [h.view() for h in self.registry.candidates(("decode",))]
        route = RouteRequest(state.request_id, state.prep.prompt_token_ids, hashes)
        matched = self.policy.prefix_match(route, views)
        return max(matched.values(), default=0) * (self.legs.block_size() or 0)

    def _disagg_flow(self, state: RequestState) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        if self.config.disagg_mode == "concurrent" and concurrent_disagg.applies(state):
            return concurrent_disagg.run(self, state)
        return self._disaggregated(state)

    async def _disaggregated(self, state: RequestState) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        """Prefill leg (max_tokens=1) on a prefill worker, its first token straight to the client,
        then the decode leg continues AFTER that token (prefill_output_token_ids) with the KV the
        prefill worker hands over: every token is sampled once, so the output equals an
        aggregated run token for token (greedy, and seeded since seeds are per output position)."""
        prep = state.prep
        self.metrics.disaggregated.inc()
        prefill_params = common_pb2.SamplingParams()
        prefill_params.CopyFrom(prep.sampling_params)
        prefill_params.max_tokens = 1
        if prefill_params.HasField("min_tokens"):
            # Keep EOS masked for the first token when the client asked for min_tokens >= 1.
            prefill_params.min_tokens = min(prefill_params.min_tokens, 1)
        wanted = prep.sampling_params.max_tokens if prep.sampling_params.HasField("max_tokens") else 16
        prefill = worker_pb2.WorkerGenerateRequest(
            request_id=prep.request_id, prompt_token_ids=prep.prompt_token_ids, sampling_params=prefill_params,
            stream=False, images=prep.images)
        if prep.images:  # E before P: the prefill leg fetches encoder outputs instead of encoding
            await self.ec.prepare(state)
            self.ec.attach(state, prefill)
        if wanted > 1:
            # A hand-off: the prefill worker keeps the KV for the decode leg and holds back text
            # that may still become a stop string (the decode leg emits it). One token wanted:
            # the prefill leg is the whole request.
            prefill.kv_transfer_params.do_remote_decode = True
        last = await self.legs.run_prefill(state, prefill)
        if last is not None and prep.images:
            self.ec.record_leg(state, "prefill", last)  # what the prefill worker now holds for others
        last = check_prefill(last)
        state.route.disaggregated = True
        if last.finish_reason == common_pb2.FINISH_REASON_STOP or wanted <= len(last.token_ids):
            # EOS / stop token / stop string on the first token, or max_tokens=1: already complete.
            # (The producer's blocks are released by the abort below or, at worst, lease expiry.)
            if last.HasField("kv_transfer_params"):
                self._abort_on_workers(prep.request_id, list(state.touched.values()))
            last.ClearField("kv_transfer_params")
            yield last
            return
        first = first_delta(prep.request_id, last)
        decode = worker_pb2.WorkerGenerateRequest(request_id=prep.request_id, prompt_token_ids=prep.prompt_token_ids,
                                                  sampling_params=continuation_params(prep.sampling_params),
                                                  stream=prep.stream,
                                                  prefill_output_token_ids=last.token_ids,
                                                  images=prep.images)  # same block hashes as the prefill leg
        if last.HasField("kv_transfer_params"):
            # The decode leg reads the KV instead of computing it; without params (the prefill
            # worker kept nothing) the decode worker computes the prompt itself, still after t0.
            decode.kv_transfer_params.CopyFrom(last.kv_transfer_params)
            decode.kv_transfer_params.do_remote_decode = False
            decode.kv_transfer_params.do_remote_prefill = True
            self.metrics.kv_transfer_tokens.inc(last.kv_transfer_params.num_tokens)
        else:
            # No hand-off: the decode worker computes the prompt, images included, so it fetches
            # their encoder outputs too (with the KV it never needs them: none are attached, and
            # nothing is fetched for nothing).
            self.ec.attach(state, decode)
        trace("r.decode_sent", prep.request_id)
        decode_leg = self.legs.run(state, ("decode",), decode, leg="decode")
        # The decode leg starts before t0 goes out, so the decode worker admits the request and
        # pulls the KV while the frontend writes t0 (measured: the write sat on the hand-off).
        # t0 is as good as sent: the leg must not be retried elsewhere as if nothing had been
        # (the same rule as when it started after the write).
        state.sent_to_client = True
        head = asyncio.ensure_future(anext(decode_leg))
        try:
            yield first  # TTFT is the prefill leg's, not the prefill + transfer + decode step
            resp = await head
        except BaseException:
            head.cancel()
            await asyncio.gather(head, return_exceptions=True)
            await decode_leg.aclose()  # its finally cancels the worker call
            raise
        while True:
            if resp.token_ids:
                trace("r.decode_token", prep.request_id)
            if resp.HasField("usage"):
                # The decode worker counts only what it sampled; t0 came from the prefill leg.
                resp.usage.completion_tokens += len(last.token_ids)
            yield resp
            try:
                resp = await anext(decode_leg)
            except StopAsyncIteration:
                return

    def _observe(self, state: RequestState, resp: worker_pb2.WorkerGenerateResponse) -> None:
        n = len(resp.token_ids)
        if not n:
            return
        now = time.monotonic()
        if state.num_generated == 0:
            state.mark_first_token()
            self.metrics.ttft.observe(now - state.prep.arrival)
            if n > 1:
                self.metrics.observe_tokens(n - 1, now, now)
        else:
            self.metrics.observe_tokens(n, now, state.last_token_at)
        state.last_token_at = now
        state.num_generated += n
        state.output_token_ids.extend(resp.token_ids)

    def _close(self, state: RequestState) -> None:
        if self._running.pop(state.request_id, None) is None:
            return
        for call in state.active_calls.values():
            call.cancel()
        state.active_calls.clear()
        if not state.finished_cleanly and state.touched:
            self._abort_on_workers(state.request_id, list(state.touched.values()))
        m = self.metrics
        m.count_request(state.frontend, state.status)
        m.e2e.observe(time.monotonic() - state.prep.arrival)
        m.prompt_tokens.inc(len(state.prep.prompt_token_ids))
        m.generation_tokens.inc(state.num_generated)

    def _abort_on_workers(self, request_id: str, handles: Sequence) -> None:
        # In the background: the cancelled request must not wait for slow or dead workers.
        for handle in handles:
            task = asyncio.get_running_loop().create_task(self._abort_one(handle, request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    @staticmethod
    async def _abort_one(handle, request_id: str) -> None:
        try:
            await handle.client.abort([request_id], _ABORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.debug("abort of %s on %s: %s", request_id, handle.address, e.code().name)

    # -- Router.Abort ---------------------------------------------------------------------------
    async def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Abort running requests by id; the client's stream ends with finish_reason ABORT."""
        known = []
        for request_id in request_ids:
            state = self._running.get(request_id)
            if state is None:
                continue
            known.append(request_id)
            state.aborted = True
            for address, call in list(state.active_calls.items()):
                aborted: list[str] = []
                try:
                    aborted = await state.touched[address].client.abort([request_id], _ABORT_TIMEOUT_S)
                except grpc.aio.AioRpcError:
                    pass
                if request_id not in aborted:
                    call.cancel()  # the worker did not know it (yet): stop reading ourselves
                else:
                    # The worker ends the stream with ABORT; should it not, stop reading anyway.
                    asyncio.get_running_loop().call_later(_ABORT_GRACE_S, call.cancel)
        return known

    async def close(self) -> None:
        await self.stall_watch.close()
        for task in list(self._background):
            await asyncio.gather(task, return_exceptions=True)


def _not_cancelling() -> bool:
    task = asyncio.current_task()
    return task is None or task.cancelling() == 0
