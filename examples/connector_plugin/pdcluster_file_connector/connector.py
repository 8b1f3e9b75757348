"""FileConnector: a KV connector that hands a prefill's blocks to a decode engine through files.

    producer                                         consumer
    request_finished -> delay_free, KVTransferParams(transfer_id, extra["file_ttl_s"])
    next step: write DIR/<tid>.kv (tmp + rename)     get_num_new_matched_tokens -> (prompt, async)
               -> finished_sending: blocks freed     update_state_after_alloc -> load in a thread:
    unread after lease_ttl_s: delete the file,          wait for DIR/<tid>.kv (or <tid>.expired),
               leave DIR/<tid>.expired                  copy into our blocks, delete the file
                                                     -> finished_recving (failed blocks on error)

The file holds the blocks as one (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
array in the cache dtype. Paths are built from this engine's configured directory and a transfer
id checked to be 32 hex characters: nothing in request data names a path.

The params are the contract's KVTransferParams: the common fields say what they say
(transfer_id, producer_id, num_tokens, block_size, lease_expiry_time); what is this connector's
own (here, the producer's lease length, informational) goes in `extra`, which a router carries
with its type.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pdcluster.connectors import (
    KVCacheLayout,
    KVConnector,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferParams,
    Request,
    RequestStatus,
    SchedulerOutput,
)

_HEX32 = re.compile(r"^[0-9a-f]{32}$")


@dataclass
class FileMetadata(KVConnectorMetadata):
    saves: list[dict[str, Any]] = field(default_factory=list)  # request_id, transfer_id, block_ids
    # request_id, transfer_id, local_block_ids, first_block, expiry (Unix seconds)
    loads: list[dict[str, Any]] = field(default_factory=list)


class FileConnector(KVConnector):
    name = "file"

    def __init__(self, role: KVConnectorRole, engine_config: Any, options: dict[str, Any]) -> None:
        super().__init__(role, options.get("failure_policy", "fail"))
        if not options.get("dir"):
            raise ValueError("the file connector needs kv_connector_options['dir']")
        self.dir = os.path.abspath(options["dir"])
        os.makedirs(self.dir, exist_ok=True)
        self.ttl_s = float(options.get("lease_ttl_s", 60.0))
        self.load_timeout_s = float(options.get("load_timeout_s", 10.0))
        self.block_size = engine_config.cache.block_size
        self.kv_role = engine_config.kv_role
        self._meta = FileMetadata()
        self._loading: set[str] = set()
        # worker side
        self._kv: Any = None
        self._lock = threading.Lock()
        self._written: dict[str, float] = {}  # transfer id -> expiry (monotonic)
        self._sent: set[str] = set()
        self._recvd: set[str] = set()
        self._failed: set[int] = set()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="file-kv-load")

    def _path(self, transfer_id: str, suffix: str) -> str:
        if not _HEX32.match(transfer_id):
            raise ValueError(f"bad transfer id {transfer_id[:40]!r}")
        return os.path.join(self.dir, f"{transfer_id}.{suffix}")

    # == scheduler side ===========================================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        kv = request.kv_transfer_params
        if kv is None or not kv.do_remote_prefill or request.request_id in self._loading:
            return 0, False
        if kv.num_tokens != request.num_prompt_tokens or not _HEX32.match(kv.transfer_id):
            raise ValueError("kv_transfer_params do not describe this prompt (num_tokens / transfer_id)")
        return kv.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        kv = request.kv_transfer_params
        if kv is None or not kv.do_remote_prefill or num_external_tokens <= 0 or request.request_id in self._loading:
            return
        first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
        end = -(-request.num_prompt_tokens // self.block_size)
        self._loading.add(request.request_id)
        self._meta.loads.append({"request_id": request.request_id, "transfer_id": kv.transfer_id,
                                 "local_block_ids": list(block_ids[first:end]), "first_block": first,
                                 "expiry": kv.lease_expiry_time})

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._meta = self._meta, FileMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        self._loading.discard(request.request_id)
        kv = request.kv_transfer_params
        if kv is None or not kv.do_remote_decode or request.status != RequestStatus.FINISHED_LENGTH or not block_ids:
            return False, None
        tid = secrets.token_hex(16)
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        self._meta.saves.append({"request_id": request.request_id, "transfer_id": tid,
                                 "block_ids": list(block_ids[:num_blocks])})
        return True, KVTransferParams(do_remote_prefill=True, connector=self.name, request_id=request.request_id,
                                      transfer_id=tid, producer_id=f"file:{os.getpid()}",
                                      num_tokens=request.num_prompt_tokens, block_size=self.block_size,
                                      lease_expiry_time=time.time() + self.ttl_s, extra={"file_ttl_s": self.ttl_s})

    # == worker side ==============================================================================
    def register_kv_caches(self, kv_caches: Any, layout: KVCacheLayout) -> None:
        self._kv = kv_caches  # (L, 2, num_blocks, block_size, H, D)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        self._expire()
        if not isinstance(meta, FileMetadata):
            return
        for save in meta.saves:  # the blocks are held (delay_free) until we report them sent
            self._save(save)
        for load in meta.loads:
            self._pool.submit(self._load, load)

    def _save(self, save: dict[str, Any]) -> None:
        path = self._path(save["transfer_id"], "kv")
        data = self._kv[:, :, torch.tensor(save["block_ids"], dtype=torch.long)].contiguous()
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data.view(torch.uint8).numpy().tobytes())
        os.replace(tmp, path)  # readers never see a partial file
        with self._lock:
            self._written[save["transfer_id"]] = time.monotonic() + self.ttl_s
            self._sent.add(save["request_id"])  # the file is the copy: free the blocks now

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [tid for tid, expiry in self._written.items() if expiry < now]
            for tid in gone:
                del self._written[tid]
        for tid in gone:
            try:
                os.replace(self._path(tid, "kv"), self._path(tid, "expired"))  # tell waiting readers
                os.truncate(self._path(tid, "expired"), 0)
            except FileNotFoundError:
                pass  # consumed already

    def _load(self, load: dict[str, Any]) -> None:
        local = load["local_block_ids"]
        try:
            if load["expiry"] and time.time() > load["expiry"]:
                raise FileNotFoundError(f"transfer {load['transfer_id']} expired before it was read")
            path = self._path(load["transfer_id"], "kv")
            deadline = time.monotonic() + self.load_timeout_s
            while not os.path.exists(path):
                if os.path.exists(self._path(load["transfer_id"], "expired")) or time.monotonic() > deadline:
                    raise FileNotFoundError(f"no KV file for transfer {load['transfer_id']} (expired or never written)")
                time.sleep(0.01)
            shape = (self._kv.shape[0], 2, -1, *self._kv.shape[3:])
            raw = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8)
            data = raw.view(self._kv.dtype).view(shape)
            first = load["first_block"]
            self._kv[:, :, torch.tensor(local, dtype=torch.long)] = data[:, :, first:first + len(local)]
            os.unlink(path)
        except (OSError, RuntimeError, ValueError):
            with self._lock:
                self._failed.update(local)
        with self._lock:
            self._recvd.add(load["request_id"])

    def wait_for_layer_load(self, layer: int) -> None:
        return None

    def save_kv_layer(self, layer: int, kv_layer: Any, meta: KVConnectorMetadata) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self._lock:
            out = (self._sent, self._recvd)
            self._sent, self._recvd = set(), set()
            return out

    def get_failed_blocks(self) -> set[int]:
        with self._lock:
            out, self._failed = self._failed, set()
            return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
