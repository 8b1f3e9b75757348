"""WorkerClient: the router's gRPC channel to one worker (Worker service + standard health).

Requests go over one multiplexed Worker.GenerateStream (worker_stream.py) or, with
multiplex=False, one Worker.Generate call each; both return an object the legs read alike."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc
from pdcluster.worker.options import DEFAULT_MAX_MESSAGE_BYTES as WORKER_SEND_BYTES
from pdcluster.worker.tls import TLSConfig, channel_credentials, channel_tls_options

from .worker_stream import StreamCall, WorkerStream

WORKER_HEALTH_SERVICE = "pdcluster.v1.Worker"


# What the router takes from its (authenticated) workers in one message: the workers' own send
# limit. A reply above the client-facing max_message_bytes (a long answer's logprobs, a long
# prompt's prompt_logprobs) must not fail the multiplexed stream, and with it every request on it
# and the worker's health; requests are bounded so that no answer gets near it
# (Preprocessor.check_logprob_volume).
WORKER_REPLY_BYTES = WORKER_SEND_BYTES


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max(max_message_bytes, WORKER_REPLY_BYTES)),
        # A restarted worker should be found within about a health period, not after gRPC's
        # default backoff of up to 120 s.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # The router decides about retries (only before the first token); gRPC must not.
        ("grpc.enable_retries", 0),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def _credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    if tls.ca is None or tls.cert is None or tls.key is None:
        return channel_credentials(tls)
    # mTLS: read a matching key/cert pair even while `keys` reissues them (rotation.py); a new
    # channel (a reconnecting router) thus presents the current certificate.
    from pdcluster.security.rotation import load_client_credentials

    return load_client_credentials(tls.ca, tls.cert, tls.key)


class WorkerClient:
    def __init__(self, address: str, *, max_message_bytes: int = 4 << 20, tls: TLSConfig | None = None,
                 multiplex: bool = True) -> None:
        self.address = address
        options: list = channel_options(max_message_bytes)
        if tls is None:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self.channel = grpc.aio.secure_channel(address, _credentials(tls),
                                                   options=options + channel_tls_options(tls))
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._stream = WorkerStream(self.stub, address, max_message_bytes) if multiplex else None

    async def check_health(self, timeout_s: float) -> bool:
        """True when the worker answers SERVING; False on NOT_SERVING or any RPC error."""
        try:
            resp = await self._health.Check(
                health_pb2.HealthCheckRequest(service=WORKER_HEALTH_SERVICE), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def stats(self, timeout_s: float) -> common_pb2.WorkerStats:
        return await self.stub.Stats(worker_pb2.StatsRequest(), timeout=timeout_s)

    async def info(self, timeout_s: float) -> worker_pb2.WorkerInfo:
        return await self.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=timeout_s)

    def generate(self, request: worker_pb2.WorkerGenerateRequest,
                 timeout_s: float | None) -> grpc.aio.UnaryStreamCall | StreamCall:
        if self._stream is not None:
            return self._stream.start(request, timeout_s)
        return self.stub.Generate(request, timeout=timeout_s)

    async def encode(self, request_id: str, images: Sequence[bytes], timeout_s: float | None) -> worker_pb2.EncodeResponse:
        """Worker.Encode: run the encoder on the images; where their outputs are held."""
        return await self.stub.Encode(worker_pb2.EncodeRequest(request_id=request_id, images=list(images)),
                                      timeout=timeout_s)

    async def provide_kv_params(self, request: worker_pb2.ProvideKVParamsRequest, timeout_s: float | None) -> None:
        """Worker.ProvideKVParams: the prefill leg's result for a decode leg waiting there."""
        await self.stub.ProvideKVParams(request, timeout=timeout_s)

    async def abort(self, request_ids: Sequence[str], timeout_s: float = 5.0) -> list[str]:
        resp = await self.stub.Abort(common_pb2.AbortRequest(request_ids=list(request_ids)), timeout=timeout_s)
        return list(resp.aborted_request_ids)

    @property
    def num_active(self) -> int:
        """Requests on the multiplexed stream now (0 for per-call channels: their close waits)."""
        return len(self._stream._calls) if self._stream is not None else 0

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
        await self.channel.close(grace=None)
