"""StoreConnector: KV blocks through a shared object store (DESIGN.md section 7; registry name "store").

One class for both engine roles; each instance delegates to its half:

    SCHEDULER role -> StoreScheduler  (scheduler_side.py: lookups, loads and saves to start, events)
    WORKER role    -> StoreWorker     (worker_side.py: pack/unpack, background puts and gets)

Unlike P2P there is no hand-off between two named engines: every instance saves the full blocks
it computes and loads the longest prefix any instance stored, so aggregated instances share
prefixes and a disaggregated decode leg finds its prefill leg's blocks by their hashes. The
objects are cut into StoreLayout shards, so instances of different TP sizes share them (given the
same `tp_sizes` or `store_tp_size` option everywhere). With tensor_parallel_size > 1 every rank
builds its own worker half; the step metadata reaches ranks > 0 through metadata_from_dict, and a
request's load (or save) counts as done only once every rank reported its shards done, while a
block any rank failed to load is failed for all (pdcluster/engine/connector_hooks.py).
Options: options.py. Built by the registry as StoreConnector(role, engine_config, options).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdcluster.config import EngineConfig
from pdcluster.engine.block_pool import KVEvent
from pdcluster.engine.kv_connector import (
    KVCacheLayout,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferParams,
)
from pdcluster.engine.outputs import SchedulerOutput
from pdcluster.engine.request import Request

from .backend import StoreBackend
from .meta import StoreConnectorMetadata
from .options import StoreOptions
from .scheduler_side import StoreScheduler
from .worker_side import StoreWorker


class StoreConnector(KVConnectorBase):
    name = "store"
    # tls_identity="worker": the launcher's request to reach the store with the worker's own
    # mTLS identity (pdcluster/worker/assembly.py fills tls_cert/tls_key/tls_ca from it).
    deployment_options = frozenset({"tls_identity"})

    def __init__(self, role: KVConnectorRole, engine_config: EngineConfig, options: dict[str, Any],
                 backend: StoreBackend | None = None) -> None:
        self.opts = StoreOptions.from_dict(dict(options or {}), engine_config)
        super().__init__(role, self.opts.failure_policy)
        block_size = engine_config.cache.block_size
        self._sched = StoreScheduler(self.opts, block_size, backend) if role == KVConnectorRole.SCHEDULER else None
        self._worker = StoreWorker(self.opts, backend) if role == KVConnectorRole.WORKER else None

    @property
    def layout(self) -> Any:
        return self.opts.layout

    def _s(self) -> StoreScheduler:
        if self._sched is None:
            raise RuntimeError("scheduler-side call on a worker-role StoreConnector")
        return self._sched

    def _w(self) -> StoreWorker:
        if self._worker is None:
            raise RuntimeError("worker-side call on a scheduler-role StoreConnector")
        return self._worker

    # -- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        return self._s().request_finished(request, block_ids)

    def take_events(self) -> list[KVEvent]:
        return self._s().take_events()

    def metadata_from_dict(self, d: dict[str, Any]) -> KVConnectorMetadata:
        # TP ranks > 0 receive each step's metadata as its to_dict() inside the step broadcast;
        # every rank then loads and saves only the StoreLayout shards of its own KV heads.
        return StoreConnectorMetadata.from_dict(d)

    def get_stats(self) -> dict[str, Any]:
        return self._sched.stats() if self._sched is not None else self._w().stats()

    # -- worker side -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Any, layout: KVCacheLayout) -> None:
        self._w().register(kv_caches, layout)

    def handshake_metadata(self) -> Any:
        return {"connector": "store", "key_prefix": self.opts.layout.key_prefix}

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        self._w().start(meta if isinstance(meta, StoreConnectorMetadata) else None)

    def wait_for_layer_load(self, layer: int) -> None:
        return None  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KV

    def save_kv_layer(self, layer: int, kv_layer: Any, meta: KVConnectorMetadata) -> None:
        self._w().save_layer(layer, kv_layer)

    def wait_for_save(self) -> None:
        self._w().wait_for_save()

    def get_finished(self) -> tuple[set[str], set[str]]:
        return self._w().get_finished()

    def get_failed_blocks(self) -> set[int]:
        return self._w().get_failed_blocks()

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self._w().wake = wake

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()


__all__ = ["StoreConnector"]
