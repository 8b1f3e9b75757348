"""Migration: resume a request on another worker when its leg fails after output was streamed.

Before the first token a failed leg is simply retried (legs.py). After it, a retry from scratch
would repeat output, so the request continues instead from the prompt plus exactly the tokens the
client was sent, as a decode leg with `prefill_output_token_ids` = those tokens and no KV hand-off
(the new worker computes the prompt's and those tokens' KV itself). The engine treats such tokens
as output already generated (llm_engine.prepare_request): they count against max_tokens and
min_tokens, the penalties count them as output, a seeded request's next token is drawn at output
position len(tokens) (sampler: randomness from (seed, position) only), and the detokenizer and
stop-string state replay them -- what was streamed counts as emitted, what the failed worker held
back stays held. So greedy and seeded output continue token for token as without the fault and
the client sees one stream; usage counts the whole completion.

    applies(state, err)   a worker-side failure after output, migrations enabled, not aborted,
                          deadline left
    StallWatch            with stall_timeout_s: a leg silent that long after the first token
                          (a SIGSTOPped or hung worker) is cancelled and counts as failed
    resume(state, err)    the next leg (counted in pdcluster_router_migrations_total{reason}), or
                          a RouterError naming the cause once max_migrations are spent or no
                          other worker is left
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping

import grpc

from pdcluster._proto import worker_pb2

from .config import RouterConfig
from .errors import RouterError
from .legs import LegRunner, continuation_params
from .metrics import RouterMetrics
from .registry import WorkerRegistry
from .request_state import RequestState

log = logging.getLogger(__name__)

# Where a resumed request runs: any worker that decodes; a prefill worker only when none is left
# (it runs the request whole, like an aggregated one, since no hand-off is asked for).
RESUME_ROLES = ("decode", "both")
FALLBACK_ROLES = ("prefill",)
# A failed leg's code -> the reason label. Other codes (DEADLINE_EXCEEDED, CANCELLED, the
# worker's verdict on the request) end the request as before.
_REASONS = {
    grpc.StatusCode.UNAVAILABLE: "worker_lost",       # killed, stream lost, ejected
    grpc.StatusCode.INTERNAL: "worker_error",         # a failed step, a stream without an end
    grpc.StatusCode.RESOURCE_EXHAUSTED: "worker_busy",
    grpc.StatusCode.ABORTED: "worker_busy",
}
_DEFAULT_MAX_TOKENS = 16  # SamplingParams' default, for requests that leave it unset


class Migrator:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, legs: LegRunner,
                 metrics: RouterMetrics) -> None:
        self.config = config
        self.registry = registry
        self.legs = legs
        self.metrics = metrics

    def applies(self, state: RequestState, err: RouterError) -> bool:
        if self.config.max_migrations <= 0 or not state.sent_to_client or state.aborted:
            return False
        if err.code not in _REASONS:
            return False
        remaining = state.prep.remaining()
        return remaining is None or remaining > 0

    def resume(self, state: RequestState, err: RouterError) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        """The leg that continues the request after `err`; raises RouterError when it cannot."""
        prep = state.prep
        prior = list(state.output_token_ids)
        reason = "stalled" if state.stalled else _REASONS[err.code]
        state.stalled = None
        where = f"request {prep.request_id}: its worker failed after {len(prior)} tokens ({err.message})"
        if state.num_migrations >= self.config.max_migrations:
            self.metrics.migrations_exhausted.inc()
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{where}; not resumed again: it was already moved "
                              f"{state.num_migrations} times (max_migrations={self.config.max_migrations})")
        params = prep.sampling_params
        max_tokens = params.max_tokens if params.HasField("max_tokens") else _DEFAULT_MAX_TOKENS
        if len(prior) >= max_tokens:
            # Every token was sent but the final delta (finish reason, usage) was lost with the worker.
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{where}; all {max_tokens} tokens were sent, "
                              "but the end of the stream was lost")
        roles = self._roles(state)
        if roles is None:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{where}; no other healthy worker to resume it on")
        state.num_migrations += 1
        state.last_token_at = time.monotonic()  # the new leg gets a whole stall window
        state.route.num_migrations = state.num_migrations
        self.metrics.migrations.labels(reason).inc()
        log.warning("%s; resuming it on another %s worker (migration %d of at most %d)", where, "/".join(roles),
                    state.num_migrations, self.config.max_migrations)
        wreq = worker_pb2.WorkerGenerateRequest(request_id=prep.request_id, prompt_token_ids=prep.prompt_token_ids,
                                                sampling_params=continuation_params(params), stream=prep.stream,
                                                prefill_output_token_ids=prior, images=prep.images)
        # The images ride again (the router keeps them until the request ends); so do the EC
        # params: a worker that cannot fetch them encodes locally.
        wreq.ec_transfer_params.extend(state.ec_params)
        return self._leg(state, roles, wreq, len(prior))

    def _roles(self, state: RequestState) -> tuple[str, ...] | None:
        for roles in (RESUME_ROLES, FALLBACK_ROLES):
            if any(h.address not in state.failed_workers for h in self.registry.candidates(roles)):
                return roles
        return None

    async def _leg(self, state: RequestState, roles: tuple[str, ...], wreq: worker_pb2.WorkerGenerateRequest,
                   num_prior: int) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        async for resp in self.legs.run(state, roles, wreq, leg="decode", exclude=state.failed_workers):
            if resp.HasField("usage"):
                # The worker counts only what it sampled; the tokens it resumed after came before.
                resp.usage.completion_tokens += num_prior
            yield resp


class StallWatch:
    """Cancels the leg of a request that has had output but no delta for timeout_s: the leg then
    fails as UNAVAILABLE (legs.py) and the request migrates. One sweep every quarter timeout over
    the running requests: nothing per token."""

    def __init__(self, timeout_s: float, running: Mapping[str, RequestState]) -> None:
        self.timeout_s = timeout_s
        self._running = running
        self._task: asyncio.Task | None = None

    def ensure_started(self) -> None:
        if self._task is None and self.timeout_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="router-stall-watch")

    async def _loop(self) -> None:
        period = max(0.02, self.timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for state in list(self._running.values()):
                if (state.sent_to_client and state.active_calls and state.stalled is None
                        and not state.finished_cleanly and now - state.last_token_at > self.timeout_s):
                    address, call = next(iter(state.active_calls.items()))
                    log.warning("request %s: no output from %s for %.1fs; moving it", state.request_id, address,
                                now - state.last_token_at)
                    state.stalled = address
                    call.cancel()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
