"""AsyncEngine: the services' view of the engine.

One background thread owns the LLMEngine and steps it; asyncio callers talk to it through a
command queue and get their per-request deltas through an asyncio.Queue each. torch releases the
GIL inside its ops, so the event loop stays responsive while a step runs.

    caller (event loop)                      engine thread
    generate() --("add", request)--> cmds -> add_prepared(); step(); ... --call_soon_threadsafe--> stream queue
    abort() / cancelled --("abort")--> cmds -> abort() (frees blocks)
    settle_handoff()    --("settle")--> cmds -> a decode leg that never entered the engine
                                               lets its producer's KV go (drop_unadmitted)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pdcluster.config import EngineArgs, EngineConfig
from pdcluster.engine.block_pool import KVEvent
from pdcluster.engine.ec_transfer_params import ECTransferParams
from pdcluster.engine.engine_counters import EngineCounters
from pdcluster.engine.kv_transfer_params import KVTransferParams
from pdcluster.engine.llm_engine import LLMEngine, check_prior_tokens
from pdcluster.engine.outputs import CompletionOutput, RequestOutput
from pdcluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05
_SETTLED_MEMORY = 4096  # hand-offs remembered as settled, so a second settle is a no-op


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        """`engine`: a built engine, or a factory that the engine thread calls to build it
        (`from_engine_args` does). Built there, every torch op of the engine (load, packing,
        warm-up, steps) runs on one thread, so OpenMP keeps a single pool of worker threads. An
        engine built on another thread leaves that thread's idle pool behind; libgomp then counts
        more managed threads than CPUs and throttles its spin-wait, and every parallel region pays
        a futex wake-up: batch-1 decode of the 125M Llama on 2 cores took 42 ms per token stepped
        on a second thread vs 17-20 ms built and stepped on one (benchmarks/RESULTS.md)."""
        self._built: Future[LLMEngine] = Future()
        self._go = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(engine,), name="pdcluster-engine", daemon=True)
        self._thread.start()
        engine = self._built.result()  # the factory's error, if any, is raised here
        self.engine = engine
        try:
            self._init_fields(engine)
        except BaseException:
            self._stop.set()  # the thread's loop ends at once; the built engine is shut down
            self._go.set()
            engine.shutdown()
            raise
        self._go.set()  # every field is set: the engine thread may run its loop

    def _init_fields(self, engine: LLMEngine) -> None:
        # Streams get deltas; keeping each finished request's whole result (LLM's offline need)
        # would grow without bound in a long-running service.
        engine.output_processor.keep_finished = False
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams (both threads touch it)
        # The engine thread's own view: the stream of each request it runs, set when the add is
        # applied. Outputs go to a stream only when both maps agree, so a step that ran before an
        # aborted request's abort was applied never reaches a newer request reusing its id.
        self._live: dict[str, _Stream] = {}
        # Engine thread only: decode legs with a producer's KV (request id, transfer id) that the
        # engine took, and those already settled. A leg the engine never took is settled by
        # telling the connector (drop_unadmitted); one it took, by its own finish.
        self._handoffs_taken: set[tuple[str, str]] = set()
        self._handoffs_settled: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._dead: BaseException | None = None
        self.stats: dict[str, Any] = engine.get_stats()  # snapshot swapped after every step
        self.last_step_time = time.monotonic()
        # Tokens served and step times, read by the worker's metrics at scrape time.
        self.counters = EngineCounters()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, connector: Any = None, ec_connector: Any = None) -> AsyncEngine:
        return cls(lambda: LLMEngine.from_engine_args(args, connector=connector, ec_connector=ec_connector))

    # -- the facade: what services read of the engine (nothing outside engine/ reaches further) --
    @property
    def config(self) -> EngineConfig:
        """The frozen engine configuration (model, cache, scheduler, parallel)."""
        return self.engine.config

    @property
    def model_path(self) -> str:
        return self.engine.config.model.model_path

    @property
    def block_size(self) -> int:
        return self.engine.config.cache.block_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    def new_request_id(self) -> str:
        return self.engine.new_request_id()

    def decode_token(self, token_id: int) -> str:
        """One token's text, special tokens kept (for logprob entries)."""
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def ec_endpoint(self) -> tuple[str, bytes] | None:
        """(host:port, CURVE public key) of this engine's EC producer endpoint (for GetInfo), or None
        without an EC connector or when it only consumes."""
        ec = self.engine.ec
        return ec.connector.endpoint() if ec is not None else None

    async def take_kv_events(self) -> list[KVEvent]:
        """The prefix-cache events since the last call, taken on the engine thread."""
        return await self.call(_take_kv_events)

    # -- caller side ---------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive() and self.engine.core.is_healthy()

    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        prefill_output_token_ids: Sequence[int] | None = None,
        multi_modal_data: dict[str, Any] | None = None,
        ec_transfer_params: Sequence[ECTransferParams] = (),
        kv_params_later: Callable[[], Awaitable[tuple[KVTransferParams | None, Sequence[int]]]] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutput deltas until one with finished=True. ValueError for bad input;
        cancelling the iteration (or the task consuming it) aborts the request and frees its blocks.
        Decode leg: kv_transfer_params from the prefill leg (do_remote_prefill=True) and
        prefill_output_token_ids = the prefill leg's tokens (see LLMEngine.prepare_request).
        multi_modal_data: {"image": PIL images or encoded bytes} (multimodal models).
        ec_transfer_params: producers holding those images' encoder outputs: fetched (EC
        connector) before the request is scheduled; any item that fails is encoded locally.
        kv_params_later: a concurrent decode leg (no kv_transfer_params nor prefill tokens yet):
        the request is validated now and enters the engine once this returns (kv_transfer_params,
        prefill_output_token_ids); what it raises ends the request. Nothing is allocated before."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead!r}")
        runner_error = self.engine.core.health_error()  # e.g. a tensor-parallel rank died while idle
        if runner_error is not None:
            raise EngineDeadError(f"engine is not running: {runner_error}")
        try:
            prepare = functools.partial(self.engine.prepare_request, prompt, sampling_params, request_id,
                                        kv_transfer_params, prefill_output_token_ids,
                                        multi_modal_data=multi_modal_data, ec_transfer_params=ec_transfer_params,
                                        compile_grammar=False)
            # Images are decoded and preprocessed in prepare_request (a 4096^2 JPEG: ~0.35 s): on a
            # worker thread, as the grammar below, so the loop keeps serving everything else.
            request, text = await asyncio.to_thread(prepare) if multi_modal_data else prepare()
            if request.sampling_params.structured_outputs is not None:
                # xgrammar releases the GIL while it compiles: off the event loop, a schema that
                # takes seconds leaves health checks and every other stream of this worker running.
                await asyncio.to_thread(self.engine.check_grammar, request.sampling_params)
        except BaseException:  # refused: no decode leg will read the producer's blocks
            self.settle_handoff(request_id or "", kv_transfer_params)
            raise
        request_id = request.request_id
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._streams[request_id] = stream
        finished = False
        counters, num_prompt_tokens = self.counters, request.num_prompt_tokens
        try:
            await self._fetch_encoder_outputs(request)
            if kv_params_later is not None:
                kv, prior = await kv_params_later()
                request.output_token_ids = check_prior_tokens(prior, request.sampling_params,
                                                              request.num_prompt_tokens, self.engine.config)
                request.kv_transfer_params = kv
            self._send(("add", request, text, stream))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is None:  # the prompt counts once, when its first output arrives
                    counters.prompt_tokens += num_prompt_tokens
                    num_prompt_tokens = 0
                    for out in item.outputs:
                        counters.generation_tokens += len(out.token_ids)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", [request_id]))
            # After the add (if any): the engine thread knows whether it took the request.
            self.settle_handoff(request_id, request.kv_transfer_params)

    async def _fetch_encoder_outputs(self, request: Any) -> None:
        """EC consumer: fetch the request's items from their producers (connector threads; this
        coroutine only waits) and hang each output on its feature for the embedder."""
        ec = self.engine.ec
        if ec is None or not request.ec_transfer_params or not request.mm_features:
            return
        # An image this engine's own cache holds is not fetched (a racy look from this thread: at worst
        # the entry is evicted meanwhile and the tower runs).
        cache = ec.embedder.encoder_cache
        wanted = [f for f in request.mm_features if f.mm_hash not in cache]
        if not wanted:
            return
        try:
            meta = ec.connector.build_load_meta(request.request_id, wanted, request.ec_transfer_params)
            if not meta.loads:
                return
            report = await asyncio.wrap_future(ec.connector.start_load(meta))
        except Exception:  # a connector bug: this request encodes its images itself
            logger.exception("EC fetch for %s failed; encoding locally", request.request_id)
            ec.embedder.errors["connector"] += 1
            return
        for f in request.mm_features:
            f.remote_output = report.loaded.get(f.mm_hash)

    async def encode(self, request_id: str, images: Sequence[Any]) -> ECTransferParams:
        """Encode images (encoded bytes or PIL) on this engine and hold the outputs in its EC
        producer: preprocessing here, the tower on the engine thread (engine-local cache first).
        Returns the producer's params: one item per distinct image, each under a lease.
        ValueError for bad images or an engine without an EC producer."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead!r}")
        features = await asyncio.to_thread(self.engine.prepare_encode, images)
        return await self.call(lambda engine: engine.encode_prepared(request_id, features))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", [request_id]))

    def settle_handoff(self, request_id: str, kv_transfer_params: KVTransferParams | None) -> None:
        """A decode leg that was handed a producer's KV (do_remote_prefill) has ended, however it
        ended, maybe before generate() ever ran (cancelled first) or took it (refused, or its caller
        went away before the engine applied the add). If the engine never took it, the connector
        is told so the producer lets its blocks go now, not at lease expiry. Idempotent and
        thread-safe; a no-op for any other params. Call it after the leg's last generate() call."""
        kv = kv_transfer_params
        if kv is not None and kv.do_remote_prefill:
            self._send(("settle", request_id or kv.request_id, kv))

    def _send(self, cmd: tuple) -> None:
        """Queue a command for the engine thread and end an idle step's wait for it."""
        self._cmds.put(cmd)
        self.engine.core.wake()

    async def call(self, function: Callable[[LLMEngine], Any]) -> Any:
        """Run function(engine) on the engine thread (for connectors and introspection)."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._send(("call", function, fut))
        return await fut

    def get_stats(self) -> dict[str, Any]:
        """The engine's counters as of its last step (a snapshot; never blocks on the engine)."""
        return self.stats

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._send(("stop",))
        self._thread.join(timeout)
        if not self._thread.is_alive():  # the engine thread no longer touches the connector
            self.engine.shutdown()

    # -- engine thread ---------------------------------------------------------------------------
    def _main(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        try:
            built = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as e:  # noqa: BLE001 - handed to the constructor, which raises it
            self._built.set_exception(e)
            return
        self._built.set_result(built)
        self._go.wait()
        self._run()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # a bug in the loop itself: fail everyone, loudly
            logger.exception("engine thread crashed")
            self._dead = e
            self._fail_all(EngineDeadError(f"engine crashed: {e!r}"))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=_IDLE_WAIT_S) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request, text, stream = cmd
            with self._lock:
                alive = self._streams.get(request.request_id) is stream
            if alive:  # the caller may have gone away before we got here
                self.engine.add_prepared(request, text)
                self._live[request.request_id] = stream
                kv = request.kv_transfer_params
                if kv is not None and kv.do_remote_prefill:
                    self._handoffs_taken.add((request.request_id, kv.transfer_id))
        elif kind == "settle":
            self._settle(cmd[1], cmd[2])
        elif kind == "abort":
            self.engine.abort(cmd[1])
            for request_id in cmd[1]:
                self._live.pop(request_id, None)
        elif kind == "call":
            _, function, fut = cmd
            try:
                res, err = function(self.engine), None
            except Exception as e:
                res, err = None, e
            if self.engine.ec is not None:  # encode() runs no step (an encoder_only engine never steps)
                self.stats = self.engine.get_stats()
            loop = fut.get_loop()
            loop.call_soon_threadsafe(_settle, fut, res, err)

    def _settle(self, request_id: str, kv: KVTransferParams) -> None:
        key = (request_id, kv.transfer_id)
        if key in self._handoffs_settled:
            return
        self._handoffs_settled[key] = None
        while len(self._handoffs_settled) > _SETTLED_MEMORY:
            self._handoffs_settled.popitem(last=False)
        if key in self._handoffs_taken:  # its finish (or abort) told the connector
            self._handoffs_taken.discard(key)
            return
        self.engine.drop_unadmitted(request_id, kv)

    def _step(self) -> None:
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:
            # A failed step must not take the service down: fail the requests in flight, free
            # their blocks, keep serving new ones.
            logger.exception("engine step failed; aborting the requests in flight")
            if not self.engine.core.is_healthy():  # e.g. a TP rank died: no later step can succeed
                self._dead = e
            self._fail_all(RuntimeError(f"engine step failed: {e!r}"))
            return
        self.last_step_time = time.monotonic()
        self.counters.observe_step(self.last_step_time - started)
        self.stats = self.engine.get_stats()
        live = self._live
        with self._lock:  # a stream whose consumer has gone gets nothing (its loop may be closed)
            targets = [(live.pop(out.request_id, None) if out.finished else live.get(out.request_id), out)
                       for out in outputs]
            targets = [(stream, out) for stream, out in targets
                       if stream is not None and self._streams.get(out.request_id) is stream]
        for stream, out in targets:
            stream.put(out)

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            streams = dict(self._streams)
        self._live.clear()
        try:
            self.engine.abort(list(streams))
        except Exception:
            logger.exception("abort after failure also failed")
        for request_id, stream in streams.items():
            stream.put(_error_output(request_id, str(err)))


def _take_kv_events(engine: LLMEngine) -> list[KVEvent]:
    return engine.core.scheduler.take_kv_events()


def _settle(fut: asyncio.Future, res: Any, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)


def _error_output(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[],
                         outputs=[CompletionOutput(0, "", [], finish_reason="error")], finished=True,
                         error=message)
