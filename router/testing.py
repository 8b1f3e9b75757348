"""FakeWorker: a Worker gRPC service without a model, for router tests and benchmarks.

It speaks the real worker protocol (Generate, Abort, Stats, GetInfo, health; KV events when given
keys) with deterministic output: token i of a request is (last prompt token + i + 1) % vocab_size.
It keeps simulated KV blocks (one per block_size tokens of every running request) so tests can
check that cancelled requests free them, and it can be told to fail. Runnable on its own:

    python -m pdcluster.router.testing --port 0 [--role both] [--token-delay 0.01] [--key-dir DIR]
    -> prints `PDCLUSTER_READY {"address": ..., "worker_id": ...}` when serving
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc

from .worker_client import WORKER_HEALTH_SERVICE

_ROLES = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE,
          "both": common_pb2.WORKER_ROLE_BOTH}


@dataclass
class FakeWorkerOptions:
    worker_id: str = "fake-0"
    role: str = "both"
    model: str = "fake-model"
    vocab_size: int = 1024
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_model_len: int = 2048
    token_delay_s: float = 0.0  # between streamed tokens
    eos_token_id: int | None = None
    key_dir: str | None = None  # publish KV events (CURVE) to the keys' "router" client
    fail_codes: list[str] = field(default_factory=list)  # the next Generate calls fail with these
    fail_after_tokens: int | None = None  # every stream fails (UNAVAILABLE) after this many tokens


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, options: FakeWorkerOptions | None = None) -> None:
        self.opts = options or FakeWorkerOptions()
        self.epoch = time.time_ns()
        self.fail_codes = [grpc.StatusCode[c] for c in self.opts.fail_codes]
        self.running: dict[str, int] = {}  # request_id -> KV blocks held
        self._tasks: dict[str, asyncio.Task] = {}
        self.requests: list[worker_pb2.WorkerGenerateRequest] = []  # every Generate received
        self.deadlines: list[float | None] = []  # time_remaining() of each, as it arrived
        self.aborted: list[str] = []  # ids ended by Abort, cancellation or deadline
        self._abort_requested: dict[str, bool] = {}
        self._stored: set[bytes] = set()
        self._publisher = None
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.health = health_aio.HealthServicer()

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.opts.key_dir:
            self._start_publisher()
        await self.server.start()
        await self.health.set(WORKER_HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)
        if self._publisher is not None:
            self._snapshot_task.cancel()
            self._publisher.close()
            self._auth.stop()
            self._zmq.term()
            self._publisher = None

    def _start_publisher(self) -> None:
        import zmq

        from pdcluster.engine.kv_events_pub import KVEventPublisher
        from pdcluster.security.curve import CurveAuthenticator
        from pdcluster.security.keys import load_allowed_public_keys, load_keypair

        self._zmq = zmq.Context()
        self._auth = CurveAuthenticator(self._zmq).start()
        allowed = {k: v for k, v in load_allowed_public_keys(self.opts.key_dir).items() if k == "router"}
        self._publisher = KVEventPublisher(self._zmq, self._auth, load_keypair(self.opts.key_dir, "worker"), allowed,
                                           self.opts.worker_id, lambda: list(self._stored), epoch=self.epoch)
        self._snapshot_task = asyncio.get_running_loop().create_task(self._serve_snapshots())

    async def _serve_snapshots(self) -> None:
        while True:
            self._publisher.serve_snapshots(0)
            self._publisher.heartbeat()
            await asyncio.sleep(0.05)

    def _publish_prompt(self, prompt: list[int]) -> None:
        if self._publisher is None:
            return
        from pdcluster.engine.block_hash import compute_block_hashes
        from pdcluster.engine.kv_events_pub import BlockStored

        new = [h for h in compute_block_hashes(prompt, self.opts.block_size) if h not in self._stored]
        if new:
            self._stored.update(new)
            self._publisher.publish([BlockStored(tuple(new))])

    # -- Worker service -------------------------------------------------------------------------
    async def Generate(self, request: worker_pb2.WorkerGenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        self.requests.append(request)
        self.deadlines.append(context.time_remaining())
        if self.fail_codes:
            await context.abort(self.fail_codes.pop(0), "injected failure")
        rid = request.request_id
        if rid in self.running:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is running")
        prompt = list(request.prompt_token_ids)
        if not prompt or max(prompt) >= self.opts.vocab_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: empty or out of range")
        sp = request.sampling_params
        max_tokens = sp.max_tokens if sp.HasField("max_tokens") else 16
        self.running[rid] = math.ceil(len(prompt) / self.opts.block_size)
        self._tasks[rid] = asyncio.current_task()
        finish, produced = common_pb2.FINISH_REASON_LENGTH, []
        try:
            for i in range(max_tokens):
                if self.opts.token_delay_s:
                    await asyncio.sleep(self.opts.token_delay_s)
                if i == self.opts.fail_after_tokens:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "injected failure mid-stream")
                token = (prompt[-1] + i + 1) % self.opts.vocab_size
                produced.append(token)
                self.running[rid] = math.ceil((len(prompt) + len(produced)) / self.opts.block_size)
                stop = token == self.opts.eos_token_id and not sp.ignore_eos
                if stop:
                    finish = common_pb2.FINISH_REASON_STOP
                last = stop or i == max_tokens - 1
                if request.stream or last:
                    ids = [token] if request.stream else produced
                    yield self._delta(request, ids, last, finish, len(prompt), len(produced))
                if last:
                    break
            self._publish_prompt(prompt)
        except asyncio.CancelledError:
            self.aborted.append(rid)  # Abort, client cancel or deadline: blocks are freed below
            if self._abort_requested.pop(rid, False):
                # Like the real worker: an Abort RPC ends the stream with finish_reason ABORT.
                yield worker_pb2.WorkerGenerateResponse(request_id=rid, finished=True,
                                                        finish_reason=common_pb2.FINISH_REASON_ABORT)
                return
            raise
        finally:
            self.running.pop(rid, None)
            self._tasks.pop(rid, None)

    def _delta(self, request: worker_pb2.WorkerGenerateRequest, ids: list[int], finished: bool, finish: int,
               num_prompt: int, num_out: int) -> worker_pb2.WorkerGenerateResponse:
        now = time.time()
        resp = worker_pb2.WorkerGenerateResponse(
            request_id=request.request_id, token_ids=ids, text="".join(f"<{t}>" for t in ids),
            token_arrival_times=[now] * len(ids), finished=finished,
            finish_reason=finish if finished else common_pb2.FINISH_REASON_UNSPECIFIED)
        if finished:
            resp.usage.prompt_tokens, resp.usage.completion_tokens = num_prompt, num_out
            kv = request.kv_transfer_params
            if request.HasField("kv_transfer_params") and kv.do_remote_decode:
                resp.kv_transfer_params.CopyFrom(common_pb2.KvTransferParams(
                    do_remote_prefill=True, connector="fake", producer_id=self.opts.worker_id,
                    engine_epoch=self.epoch, num_tokens=num_prompt, block_size=self.opts.block_size,
                    block_ids=list(range(math.ceil(num_prompt / self.opts.block_size)))))
        return resp

    async def Abort(self, request: common_pb2.AbortRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> common_pb2.AbortResponse:
        done = []
        for rid in request.request_ids:
            task = self._tasks.get(rid)
            if task is not None:
                self._abort_requested[rid] = True
                task.cancel()
                done.append(rid)
        return common_pb2.AbortResponse(aborted_request_ids=done)

    async def Stats(self, request: worker_pb2.StatsRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> common_pb2.WorkerStats:
        used = sum(self.running.values())
        total = self.opts.num_kv_blocks
        s = common_pb2.WorkerStats(
            worker_id=self.opts.worker_id, role=_ROLES[self.opts.role], model=self.opts.model,
            num_running=len(self.running), num_kv_blocks_total=total, num_kv_blocks_used=used,
            num_kv_blocks_free=total - used, kv_usage=used / total, block_size=self.opts.block_size,
            timestamp=time.time())
        if self._publisher is not None:
            s.kv_events_endpoint = self._publisher.events_endpoint
            s.kv_snapshot_endpoint = self._publisher.snapshot_endpoint
            s.kv_events_public_key = self._publisher.public_key
            s.kv_events_epoch, s.kv_events_seq = self.epoch, self._publisher.seq
        return s

    async def GetInfo(self, request: worker_pb2.GetInfoRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            worker_id=self.opts.worker_id, role=_ROLES[self.opts.role], model=self.opts.model, dtype="float32",
            block_size=self.opts.block_size, max_model_len=self.opts.max_model_len, tp_size=1,
            num_kv_blocks_total=self.opts.num_kv_blocks, engine_epoch=self.epoch, version="fake")


async def _main(args: argparse.Namespace) -> None:
    opts = FakeWorkerOptions(worker_id=args.worker_id or f"fake-{args.port}", role=args.role,
                             model=args.model or "fake-model", token_delay_s=args.token_delay, key_dir=args.key_dir,
                             block_size=args.block_size)
    worker = FakeWorker(opts)
    port = await worker.start(args.host, args.port)
    print("PDCLUSTER_READY " + json.dumps({"address": f"{args.host}:{port}", "worker_id": opts.worker_id,
                                           "pid": os.getpid()}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await worker.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdcluster.router.testing", description="fake pdcluster worker")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--role", default="both", choices=sorted(_ROLES))
    p.add_argument("--model", default=None)
    p.add_argument("--worker-id", default=None)
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--key-dir", default=None)
    args, _unknown = p.parse_known_args(argv)  # launcher flags meant for real workers are ignored
    asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
