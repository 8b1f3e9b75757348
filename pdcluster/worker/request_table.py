"""RequestTable: what a worker tracks per running request, for the unary Generate path and the
GenerateStream session alike.

    check()        a request's sampling params and the role's verdict on its KV params, or Refusal
    track()/forget() the in-flight map (request id -> Inflight), one entry per running request
    start_pump()   the engine request as a task feeding a sink (a queue, or a stream session);
                   a concurrent decode leg (await_kv_transfer_id) waits in kv_waits first
    provide()      ProvideKVParams: the prefill leg's params and token(s) for such a waiting leg
    refusal_for()  the status an engine item ends a request with, if any
    response()     one engine item as a WorkerGenerateResponse (ABORTED: abort_response)
    abort()        cancel the pump (the engine frees the blocks) and end the request with ABORT
    draining       set: new requests are refused with UNAVAILABLE; move_all() ends the running
                   ones with UNAVAILABLE (a router resumes them on another worker)
    ended          legs this worker ended because their caller failed them, by reason (END_REASONS):
                   "deadline" (the caller's deadline passed: a stuck or stopped router, a slow path),
                   "stream_lost" (the request stream ended under them: router killed or cut off);
                   /metrics pdcluster_worker_requests_ended_total{reason}

The gRPC adapters (worker_servicer.py, worker_stream.py) own the transport: deadlines, status
codes on the wire, batching. Everything a request is, and every way it ends, lives here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import grpc

from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.engine.async_engine import AsyncEngine, EngineDeadError
from pdcluster.engine.ec_transfer_params import MAX_EC_PRODUCERS, ECTransferParams
from pdcluster.engine.kv_connector import KVTransferParams
from pdcluster.engine.outputs import RequestOutput
from pdcluster.sampling_params import SamplingParams
from pdcluster.worker import convert
from pdcluster.worker.inflight import Inflight, Refusal
from pdcluster.worker.kv_params_wait import KVParamsTimeout, KVParamsWaits, check_timeout, check_transfer_id
from pdcluster.worker.roles import KvTransferRejected, RoleHandler

log = logging.getLogger(__name__)

ABORTED = object()  # queued by abort() for a request without on_abort: end it with finish_reason ABORT
MOVED = object()  # delivered by move(): end the request with UNAVAILABLE (the worker is draining)
END_REASONS = ("deadline", "stream_lost")

# A pumped item: (arrival time, engine output), the exception that ended the request, or ABORTED.
Sink = Callable[[Any], "bool | None"]


def abort_response(request_id: str, inflight: Inflight) -> worker_pb2.WorkerGenerateResponse:
    """The final response of an aborted request (both paths send exactly this)."""
    return worker_pb2.WorkerGenerateResponse(
        request_id=request_id, finished=True, finish_reason=common_pb2.FINISH_REASON_ABORT,
        usage=common_pb2.Usage(prompt_tokens=inflight.num_prompt_tokens, completion_tokens=inflight.num_tokens))


def _provided_kv(waiter: Any) -> KVTransferParams | None:
    """The params a concurrent decode leg was given by ProvideKVParams, if it got any."""
    if waiter is None or not waiter.future.done() or waiter.future.cancelled():
        return None
    return waiter.future.result()[0]


def ec_params(request: worker_pb2.WorkerGenerateRequest) -> tuple[ECTransferParams, ...]:
    """The request's EC params, validated and bounded (ValueError naming the field)."""
    if not request.ec_transfer_params:
        return ()
    if len(request.ec_transfer_params) > MAX_EC_PRODUCERS:
        raise ValueError(f"ec_transfer_params: a request carries at most {MAX_EC_PRODUCERS} of them, "
                         f"got {len(request.ec_transfer_params)}")
    return tuple(convert.ec_params_from_proto(p) for p in request.ec_transfer_params)


class RequestTable:
    def __init__(self, engine: AsyncEngine, role: RoleHandler) -> None:
        self.engine = engine
        self.role = role
        self._eos = frozenset(engine.eos_token_ids)
        self._inflight: dict[str, Inflight] = {}
        self._pumps: dict[str, asyncio.Task] = {}  # request id -> its pump task, until that ends
        self.draining = False
        # Counted on the event loop only; the metrics thread reads ints (a torn read is impossible).
        self.ended: dict[str, int] = dict.fromkeys(END_REASONS, 0)
        self.kv_waits = KVParamsWaits()  # concurrent decode legs waiting for ProvideKVParams

    def __len__(self) -> int:
        return len(self._inflight)

    def new_request_id(self) -> str:
        return self.engine.new_request_id()

    # -- admission -------------------------------------------------------------------------------
    def check(self, request: worker_pb2.WorkerGenerateRequest,
              request_id: str) -> tuple[SamplingParams, KVTransferParams | None]:
        """The request's sampling params and accepted KV params, or Refusal (EC params are checked
        here too and converted again by the pump: they are few and small)."""
        try:
            params = convert.sampling_params_from_proto(request.sampling_params)
            eos = request.eos_token_ids
            if eos and frozenset(eos) != self._eos:
                raise ValueError(f"eos_token_ids: overriding the model's EOS tokens {sorted(self._eos)} is not "
                                 "supported; send extra ones as sampling_params.stop_token_ids")
            kv = convert.kv_params_from_proto(request.kv_transfer_params) \
                if request.HasField("kv_transfer_params") else None
            kv = self.role.accept(kv)
            ec_params(request)
            if request.await_kv_transfer_id or request.HasField("kv_params_timeout_s"):
                self._check_awaiting(request)
        except ValueError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except KvTransferRejected as e:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        if request_id in self._inflight:
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already running here")
        if not self.engine.is_healthy:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "engine is not running")
        if self.draining:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "worker is draining; send the request to another worker")
        return params, kv

    def _check_awaiting(self, request: worker_pb2.WorkerGenerateRequest) -> None:
        if not request.await_kv_transfer_id:
            raise ValueError("kv_params_timeout_s: only for a decode leg with await_kv_transfer_id")
        check_transfer_id(request.await_kv_transfer_id)
        check_timeout(request.kv_params_timeout_s if request.HasField("kv_params_timeout_s") else None)
        for name in ("kv_transfer_params", "prefill_output_token_ids", "images", "ec_transfer_params"):
            if (request.HasField(name) if name == "kv_transfer_params" else len(getattr(request, name))):
                raise ValueError(f"{name}: a decode leg with await_kv_transfer_id gets no {name} "
                                 "(the KV hand-off arrives by ProvideKVParams; images are not supported)")
        if self.role.name not in ("decode", "both") or not self.role.connector_name:
            raise KvTransferRejected(f"await_kv_transfer_id: a {self.role.name} worker without a KV consumer "
                                     "does not serve decode legs; send it to a decode worker")

    def provide(self, request: worker_pb2.ProvideKVParamsRequest) -> None:
        """ProvideKVParams: check the params like a decode leg's and hand them to the waiting leg;
        Refusal naming the field otherwise."""
        try:
            kv = convert.kv_params_from_proto(request.kv_transfer_params) \
                if request.HasField("kv_transfer_params") else None
            if kv is not None and not kv.do_remote_prefill:
                raise ValueError("kv_transfer_params: set do_remote_prefill (the decode leg's params)")
            kv = self.role.accept(kv)
        except ValueError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except KvTransferRejected as e:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        self.kv_waits.provide(request.request_id, request.transfer_id, kv, list(request.prefill_output_token_ids))

    def is_running(self, request_id: str) -> bool:
        return request_id in self._inflight

    def track(self, request_id: str, inflight: Inflight) -> None:
        self._inflight[request_id] = inflight

    def forget(self, request_id: str, inflight: Inflight) -> None:
        """Drop the entry if it is still this request's (a reused id may own it by now)."""
        if self._inflight.get(request_id) is inflight:
            del self._inflight[request_id]

    # -- running -----------------------------------------------------------------------------------
    def start_pump(self, request_id: str, request: worker_pb2.WorkerGenerateRequest, params: SamplingParams,
                   kv: KVTransferParams | None, sink: Sink) -> asyncio.Task:
        """Run the request in the engine as a task that hands sink each (arrival time, output), or
        the exception that ended it, until the request ends or sink returns true. Cancelling the
        task closes AsyncEngine.generate, which aborts the request and frees its blocks.

        An aborted request with the same id may still be leaving the engine (its cancelled task has
        not finished): the new one starts after it, so a client that reuses an id right after a
        cancel is served, not refused as a duplicate."""
        previous = self._pumps.get(request_id)
        if previous is not None and previous.done():
            previous = None
        waiter = None
        if request.await_kv_transfer_id:  # checked: registered now, so ProvideKVParams finds it at once
            timeout = check_timeout(request.kv_params_timeout_s if request.HasField("kv_params_timeout_s") else None)
            waiter = self.kv_waits.register(request_id, request.await_kv_transfer_id, timeout)
        task = asyncio.get_running_loop().create_task(self._pump(request_id, request, params, kv, sink, previous,
                                                                 waiter))
        self._pumps[request_id] = task
        task.add_done_callback(lambda t: self._pumps.pop(request_id) if self._pumps.get(request_id) is t else None)
        # However the task ends (even cancelled before it ran, so before generate() saw the
        # params), a producer's KV this leg was handed is let go if the engine never took it.
        task.add_done_callback(lambda _: self.engine.settle_handoff(request_id, kv or _provided_kv(waiter)))
        return task

    async def _pump(self, request_id: str, request: worker_pb2.WorkerGenerateRequest, params: SamplingParams,
                    kv: KVTransferParams | None, sink: Sink, previous: asyncio.Task | None,
                    waiter: Any = None) -> None:
        try:
            await self._pump_inner(request_id, request, params, kv, sink, previous, waiter)
        finally:
            if waiter is not None:
                self.kv_waits.drop(request_id, waiter)

    async def _pump_inner(self, request_id: str, request: worker_pb2.WorkerGenerateRequest, params: SamplingParams,
                          kv: KVTransferParams | None, sink: Sink, previous: asyncio.Task | None,
                          waiter: Any) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        prior = list(request.prefill_output_token_ids)  # the decode leg's; the engine validates them
        # Images: encoded bytes, decoded and preprocessed by the engine (its limits apply); their
        # placeholders are already expanded in the ids (mm_inputs.MultiModalInputProcessor).
        mm_data = {"image": list(request.images)} if request.images else None
        # Where other instances hold this request's encoder outputs (passed only when there are
        # some: an engine without an EC connector takes no such argument).
        ec = ec_params(request)
        extra: dict[str, Any] = {"ec_transfer_params": ec} if ec and mm_data else {}
        if waiter is not None:  # validated and tokenized now; enters the engine with the params
            extra["kv_params_later"] = waiter.wait
        try:
            async with aclosing(self.engine.generate(list(request.prompt_token_ids), params, request_id=request_id,
                                                     kv_transfer_params=kv, prefill_output_token_ids=prior or None,
                                                     multi_modal_data=mm_data, **extra)) as outputs:
                async for out in outputs:
                    if sink((time.time(), out)):
                        return
        except asyncio.CancelledError:
            raise
        except ValueError as e:  # bad input: name the wire field (the engine names its own argument)
            text = str(e).replace("multi_modal_data['image']", "images").replace("multi_modal_data", "images")
            sink(ValueError(text) if mm_data else e)
        except BaseException as e:  # the receiver maps it to a status code
            sink(e)

    def refusal_for(self, item: Any, sent: bool) -> Refusal | None:
        """The status a pumped item ends the request with, if any: an exception from the engine,
        or an error output before anything was sent while the engine is down (the router then
        retries elsewhere). None: send the item as a delta."""
        if item is MOVED:
            return Refusal(grpc.StatusCode.UNAVAILABLE, "worker is draining: the request was ended here so that it "
                           "continues on another worker")
        if isinstance(item, BaseException):
            if isinstance(item, ValueError):
                return Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(item))
            if isinstance(item, KVParamsTimeout):
                return Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, str(item))
            if isinstance(item, EngineDeadError):
                return Refusal(grpc.StatusCode.UNAVAILABLE, str(item))
            log.error("request failed", exc_info=item)
            return Refusal(grpc.StatusCode.INTERNAL, f"internal error: {item!r}")
        if item is not ABORTED:
            _, out = item
            if out.error and not sent and not self.engine.is_healthy:
                return Refusal(grpc.StatusCode.UNAVAILABLE, out.error)
        return None

    def response(self, request_id: str, inflight: Inflight, item: Any,
                 params: SamplingParams) -> worker_pb2.WorkerGenerateResponse:
        if item is ABORTED:
            return abort_response(request_id, inflight)
        arrival, out = item
        assert isinstance(out, RequestOutput)
        inflight.num_tokens += len(out.outputs[0].token_ids)
        wants_text = params.logprobs is not None or params.prompt_logprobs is not None
        token_text = self.engine.decode_token if wants_text and params.detokenize else None
        return convert.output_to_response(out, arrival_time=arrival, num_completion_tokens=inflight.num_tokens,
                                          token_text=token_text)

    # -- ending ------------------------------------------------------------------------------------
    def count_ended(self, reason: str, n: int = 1) -> None:
        """n legs ended here because their caller failed them (a reason of END_REASONS)."""
        self.ended[reason] += n

    def abort(self, request_id: str) -> bool:
        """End a running request with finish_reason ABORT; false if it is not running here."""
        inflight = self._inflight.get(request_id)
        if inflight is None:
            return False
        if inflight.task is not None:
            inflight.task.cancel()  # closes AsyncEngine.generate -> engine abort, blocks freed
        if inflight.on_abort is not None:
            inflight.on_abort()
        else:
            inflight.queue.put_nowait(ABORTED)
        return True

    def abort_all(self) -> int:
        return sum(self.abort(request_id) for request_id in list(self._inflight))

    def move_all(self) -> int:
        """End every running request with UNAVAILABLE (the end of a drain); their blocks are freed."""
        moved = list(self._inflight.values())
        for inflight in moved:
            if inflight.task is not None:
                inflight.task.cancel()
            (inflight.deliver or inflight.queue.put_nowait)(MOVED)
        return len(moved)
