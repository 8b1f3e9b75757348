"""The built-in store (pdcluster.kvstore) behind the StoreBackend interface.

Large batches are cut to the master's per-RPC limit. Same-host storage nodes are written and read
through shared memory (one memcpy); remote ones over the authenticated TCP data plane.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdcluster.kvstore.client import KVStoreClient, KVStoreError
from pdcluster.kvstore.entities import Status
from pdcluster.kvstore.object_mac import store_key_from_env

from .backend import PutResult, StoreBackend, StoreBackendError

MAX_KEYS_PER_RPC = 2048  # below the master's max_batch (4096) with room for long keys

_PUT = {Status.OK: PutResult.STORED, Status.ALREADY_EXISTS: PutResult.EXISTS, Status.IN_PROGRESS: PutResult.EXISTS}


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(i, min(n, i + MAX_KEYS_PER_RPC)) for i in range(0, n, MAX_KEYS_PER_RPC)]


class KVStoreBackend(StoreBackend):
    name = "kvstore"

    def __init__(self, master: str, *, replica_num: int = 1, num_streams: int = 4, use_shm: bool = True,
                 rpc_timeout_s: float = 10.0, max_parallel: int = 8, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, object_key: str | bytes | None = None) -> None:
        # object_key: the workers' store key (hex), given by the launcher; objects are MACed under it
        self._client = KVStoreClient(master, num_streams=num_streams, use_shm=use_shm, rpc_timeout_s=rpc_timeout_s,
                                     max_parallel=max_parallel, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                     object_key=object_key if object_key is not None else store_key_from_env())
        self._replica_num = replica_num
        self._closed = False

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> KVStoreBackend:
        get = options.get
        master = get("master", "127.0.0.1:50070")  # one address, "a,b" or a list: a primary/standby pair
        return cls(",".join(master) if isinstance(master, list | tuple) else str(master), replica_num=int(get("replica_num", 1)),
                   num_streams=int(get("num_streams", 4)), use_shm=bool(get("use_shm", True)),
                   rpc_timeout_s=float(get("rpc_timeout_s", 10.0)), tls_ca=get("tls_ca"),
                   tls_cert=get("tls_cert"), tls_key=get("tls_key"), object_key=get("object_key"))

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        try:
            for a, b in _chunks(len(keys)):
                out.extend(self._client.batch_exists(keys[a:b]))
        except KVStoreError as e:
            raise StoreBackendError(str(e)) from e
        return out

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[PutResult]:
        out: list[PutResult] = []
        try:
            for a, b in _chunks(len(keys)):
                statuses = self._client.batch_put(keys[a:b], buffers[a:b], replica_num=self._replica_num)
                out.extend(_PUT.get(s, PutResult.FAILED) for s in statuses)
        except KVStoreError as e:
            raise StoreBackendError(str(e)) from e
        return out

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        out: list[bool] = []
        for a, b in _chunks(len(keys)):
            try:
                sizes = self._client.batch_get(keys[a:b], buffers[a:b])
            except KVStoreError as e:
                if e.results is None:  # the master itself failed: nothing was read
                    raise StoreBackendError(str(e)) from e
                sizes = e.results  # some replicas failed: those keys are None
            except ValueError:  # an object of another size than the buffer: a schema clash, a miss
                sizes = [None] * (b - a)
            out.extend(size is not None and size == _nbytes(buf) for size, buf in zip(sizes, buffers[a:b]))
        return out

    def remove(self, keys: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        try:
            for a, b in _chunks(len(keys)):
                out.extend(s == Status.OK for s in self._client.batch_remove(keys[a:b]))
        except KVStoreError as e:
            raise StoreBackendError(str(e)) from e
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()


def _nbytes(buf: Any) -> int:
    n = getattr(buf, "nbytes", None)
    if n is None and hasattr(buf, "numel"):
        n = buf.numel() * buf.element_size()
    return int(n if n is not None else len(buf))
