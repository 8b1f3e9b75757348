"""The kvstore client's connection to the master: one gRPC stub, a per-call timeout, one error."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import Message

from pdcluster._proto import kvstore_pb2_grpc as pb_grpc

from .rpc import make_channel


class KVStoreError(Exception):
    """The master is unreachable, or an object's bytes could not be read. `results` holds what a
    batch call did get (None for misses and failures), `failed` the keys that failed."""

    def __init__(self, msg: str, results: list[Any] | None = None, failed: list[str] | None = None) -> None:
        super().__init__(msg)
        self.results = results
        self.failed = failed or []


class MasterRPC:
    def __init__(self, master_addr: str, *, timeout_s: float = 10.0, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None) -> None:
        self._channel = make_channel(master_addr, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self._stub = pb_grpc.KVStoreMasterStub(self._channel)
        self._timeout = timeout_s

    def call(self, method: str, request: Message) -> Any:
        """The master's answer to `method`; KVStoreError when the call failed."""
        try:
            return getattr(self._stub, method)(request, timeout=self._timeout)
        except grpc.RpcError as e:
            raise KVStoreError(f"kvstore master {method} failed: {e.code().name}: {e.details()}") from e

    def close(self) -> None:
        self._channel.close()


__all__ = ["KVStoreError", "MasterRPC"]
