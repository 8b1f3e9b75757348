"""Mooncake Store behind the StoreBackend interface (optional extra `pdcluster[mooncake]`).

    pip install 'pdcluster[mooncake]'     # mooncake-transfer-engine-non-cuda on CPU machines
    mooncake_master --rpc_port 50051 --rpc_address 127.0.0.1

Options (kv_connector_options, prefix `mooncake_`): `mooncake_master` HOST:PORT,
`mooncake_metadata_server` (default "P2PHANDSHAKE": peers exchange segment descriptors directly,
no etcd/HTTP metadata service), `mooncake_protocol` ("tcp" | "rdma"), `mooncake_rdma_devices`,
`mooncake_local_hostname`, `mooncake_segment_bytes` (memory this process contributes to the
pool; 0 for a pure client) and `mooncake_buffer_bytes` (the client's own transfer buffer).

Puts and gets move bytes straight from and into registered memory (`register_buffer`): the
connector registers its staging arenas once, so no call copies through Mooncake's buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .backend import PutResult, StoreBackend, StoreBackendError


def mooncake_available() -> str | None:
    """None when Mooncake Store can be used here, else why not (for skips and errors)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as e:  # ImportError, or a missing shared library (libibverbs, libnuma)
        return f"mooncake store unavailable: {type(e).__name__}: {e} (pip install 'pdcluster[mooncake]')"
    return None


def _addr_len(buf: Any) -> tuple[int, int]:
    """(address, nbytes) of a contiguous CPU tensor or numpy array."""
    if hasattr(buf, "data_ptr"):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("mooncake backend buffers must be contiguous CPU tensors")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    if hasattr(buf, "ctypes"):
        return int(buf.ctypes.data), int(buf.nbytes)
    raise TypeError(f"mooncake backend needs tensors or numpy arrays, got {type(buf).__name__}")


class MooncakeBackend(StoreBackend):
    name = "mooncake"

    def __init__(self, master: str, *, metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp",
                 rdma_devices: str = "", local_hostname: str = "127.0.0.1", segment_bytes: int = 0,
                 buffer_bytes: int = 16 << 20, replica_num: int = 1) -> None:
        why = mooncake_available()
        if why is not None:
            raise ValueError(why)
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self._store = MooncakeDistributedStore()
        code = self._store.setup(local_hostname, metadata_server, int(segment_bytes), int(buffer_bytes), protocol,
                                 rdma_devices, master)
        if code != 0:
            raise StoreBackendError(f"mooncake setup against master {master} failed (code {code})")
        self._config = ReplicateConfig()
        self._config.replica_num = int(replica_num)
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> MooncakeBackend:
        get = options.get
        return cls(str(get("mooncake_master", "127.0.0.1:50051")),
                   metadata_server=str(get("mooncake_metadata_server", "P2PHANDSHAKE")),
                   protocol=str(get("mooncake_protocol", "tcp")),
                   rdma_devices=str(get("mooncake_rdma_devices", "")),
                   local_hostname=str(get("mooncake_local_hostname", "127.0.0.1")),
                   segment_bytes=int(get("mooncake_segment_bytes", 0)),
                   buffer_bytes=int(get("mooncake_buffer_bytes", 16 << 20)),
                   replica_num=int(get("replica_num", 1)))

    def register_buffer(self, buffer: Any) -> None:
        addr, n = _addr_len(buffer)
        with self._lock:
            if addr in self._registered:
                return
            code = self._store.register_buffer(addr, n)
            if code != 0:
                raise StoreBackendError(f"mooncake register_buffer({n} bytes) failed (code {code})")
            self._registered[addr] = n

    def unregister_buffer(self, buffer: Any) -> None:
        addr, _ = _addr_len(buffer)
        with self._lock:
            if self._registered.pop(addr, None) is not None and not self._closed:
                self._store.unregister_buffer(addr)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        flags = self._store.batch_is_exist(list(keys))
        if all(f < 0 for f in flags):  # -1 is a per-key error; all of them: the store is gone
            raise StoreBackendError("mooncake batch_is_exist failed for every key")
        return [f == 1 for f in flags]

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[PutResult]:
        if not keys:
            return []
        addrs, sizes = zip(*(_addr_len(b) for b in buffers))
        # Mooncake answers 0 for a key that already exists (objects are immutable there too).
        codes = self._store.batch_put_from(list(keys), list(addrs), list(sizes), self._config)
        return [PutResult.STORED if code == 0 else PutResult.FAILED for code in codes]

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        if not keys:
            return []
        addrs, sizes = zip(*(_addr_len(b) for b in buffers))
        got = self._store.batch_get_into(list(keys), list(addrs), list(sizes))
        return [g == n for g, n in zip(got, sizes)]

    def remove(self, keys: Sequence[str]) -> list[bool]:
        # force: a just-read object keeps a short lease in Mooncake; removal is an operator's call.
        return [self._store.remove(k, True) == 0 for k in keys]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for addr in list(self._registered):
                self._store.unregister_buffer(addr)
            self._registered.clear()
        self._store.close()


__all__ = ["MooncakeBackend", "mooncake_available"]
