"""KVParamsWaits: decode legs admitted before their prefill finished (concurrent disaggregation).

The router sends the decode leg with `await_kv_transfer_id` while the prefill leg runs; the
worker checks and tracks it like any leg, but its engine request waits here, unscheduled (no
blocks held: allocation is ~0.1 ms, blocks held through a prefill would be decode capacity
lost), until the router's ProvideKVParams hands over what the prefill leg returned:

    register(request_id, transfer_id, timeout_s)   at admission (start_pump): a Waiter
    provide(request_id, transfer_id, kv, tokens)   the RPC: checked, then the Waiter is set
    Waiter.wait()                                  the pump: (kv | None, tokens), or
                                                   KVParamsTimeout after timeout_s
    drop(request_id, waiter)                       the pump ended (any way): forgotten

Binding: params are accepted only for a request waiting here under that transfer_id, once, and
only if they name that request (kv.request_id) and that transfer (kv.transfer_id, when set).
Every refusal is a Refusal naming the field; nothing is changed by a refused call.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import grpc

from pdcluster.engine.kv_transfer_params import KVTransferParams
from pdcluster.handoff_trace import trace
from pdcluster.worker.inflight import Refusal

DEFAULT_KV_PARAMS_TIMEOUT_S = 60.0
MAX_KV_PARAMS_TIMEOUT_S = 3600.0
MAX_PREFILL_OUTPUT_TOKENS = 16  # the router's prefill leg samples one
_TRANSFER_ID = re.compile(r"^[0-9a-f]{32}$")


class KVParamsTimeout(Exception):
    """A concurrent decode leg waited its whole bound for ProvideKVParams (DEADLINE_EXCEEDED)."""


def check_transfer_id(value: str, name: str = "await_kv_transfer_id") -> str:
    if not _TRANSFER_ID.match(value):
        raise ValueError(f"{name}: must be 32 lowercase hex characters, got {len(value)} characters")
    return value


def check_timeout(value: float | None) -> float:
    if value is None:
        return DEFAULT_KV_PARAMS_TIMEOUT_S
    if not 0 < value <= MAX_KV_PARAMS_TIMEOUT_S:  # also refuses NaN
        raise ValueError(f"kv_params_timeout_s: must be in (0, {MAX_KV_PARAMS_TIMEOUT_S:g}], got {value!r}")
    return value


@dataclass(eq=False)
class Waiter:
    request_id: str
    transfer_id: str
    timeout_s: float
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    async def wait(self) -> tuple[KVTransferParams | None, list[int]]:
        try:
            return await asyncio.wait_for(asyncio.shield(self.future), self.timeout_s)
        except asyncio.TimeoutError:
            raise KVParamsTimeout(
                f"decode leg {self.request_id!r} waited {self.timeout_s:g}s for its kv_transfer_params "
                "(ProvideKVParams from the router) and was ended; the prefill leg did not finish in time "
                "(kv_params_timeout_s)") from None


class KVParamsWaits:
    def __init__(self) -> None:
        self._waiting: dict[str, Waiter] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def register(self, request_id: str, transfer_id: str, timeout_s: float) -> Waiter:
        waiter = Waiter(request_id, transfer_id, timeout_s)
        self._waiting[request_id] = waiter
        return waiter

    def drop(self, request_id: str, waiter: Waiter) -> None:
        if self._waiting.get(request_id) is waiter:
            del self._waiting[request_id]
        if not waiter.future.done():
            waiter.future.cancel()

    def provide(self, request_id: str, transfer_id: str, kv: KVTransferParams | None,
                tokens: list[int]) -> None:
        """Hand the prefill's result to the waiting leg, or Refusal (nothing changed)."""
        waiter = self._waiting.get(request_id)
        if waiter is None:
            raise Refusal(grpc.StatusCode.NOT_FOUND,
                          f"request_id: no decode leg {request_id!r} is waiting for kv_transfer_params here")
        if transfer_id != waiter.transfer_id:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                          f"transfer_id: does not match the one decode leg {request_id!r} was admitted with")
        if waiter.future.done():
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"request_id: decode leg {request_id!r} already has its kv_transfer_params")
        if not 1 <= len(tokens) <= MAX_PREFILL_OUTPUT_TOKENS:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prefill_output_token_ids: 1 to {MAX_PREFILL_OUTPUT_TOKENS} tokens, got {len(tokens)}")
        if kv is not None:
            if kv.request_id and kv.request_id != request_id:
                raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                              "kv_transfer_params.request_id: the params were made for another request")
            if kv.transfer_id and kv.transfer_id != transfer_id:
                raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                              "kv_transfer_params.transfer_id: the params were made for another transfer")
        trace("d.provided", request_id)
        waiter.future.set_result((kv, list(tokens)))
