"""P2PConnector: the NIXL-style peer-to-peer KV connector (DESIGN.md section 6).

One class for both engine roles; each instance delegates to its half:

    SCHEDULER role -> P2PScheduler  (scheduler_side.py: leases to register, loads to start, params)
    WORKER role    -> P2PWorker     (worker_side.py: producer agent + side channel, consumer loader)

Built by the registry as P2PConnector(role, engine_config, kv_connector_options); the options
are documented in options.py. A producer keeps the prompt's blocks under a lease and is read in
place; a consumer pulls them over TCP (several streams, straight into its blocks) or copies them
from the producer's shared-memory cache on the same host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdcluster.config import EngineConfig
from pdcluster.engine.kv_connector import (
    KVCacheLayout,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferParams,
)
from pdcluster.engine.outputs import SchedulerOutput
from pdcluster.engine.request import Request

from .options import P2POptions
from .scheduler_side import P2PMetadata, P2PScheduler
from .worker_side import P2PWorker


class P2PConnector(KVConnectorBase):
    name = "p2p"
    deployment_options = frozenset({"keys_dir", "key_name", "engine_id"})
    frees_behind_window = True  # the hand-off sends only the blocks a window still reads (scheduler_side.py)

    def __init__(self, role: KVConnectorRole, engine_config: EngineConfig, options: dict[str, Any]) -> None:
        self.opts = P2POptions.from_dict(options, engine_config)
        super().__init__(role, self.opts.failure_policy)
        self._sched = P2PScheduler(self.opts, engine_config.cache.block_size, engine_config.model.kv_window) \
            if role == KVConnectorRole.SCHEDULER else None
        self._worker = P2PWorker(self.opts, engine_config) if role == KVConnectorRole.WORKER else None

    def _s(self) -> P2PScheduler:
        if self._sched is None:
            raise RuntimeError("scheduler-side call on a worker-role P2PConnector")
        return self._sched

    def _w(self) -> P2PWorker:
        if self._worker is None:
            raise RuntimeError("worker-side call on a scheduler-role P2PConnector")
        return self._worker

    # -- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_meta()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        return self._s().request_finished(request, block_ids)

    def abort_held(self, request_id: str) -> None:
        self._s().abort_held(request_id)

    def set_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._s().set_handshake_metadata(metadata)

    def metadata_from_dict(self, d: dict[str, Any]) -> KVConnectorMetadata:
        return P2PMetadata.from_dict(d)

    def get_stats(self) -> dict[str, Any]:
        if self._sched is not None:
            return {f"p2p_{k}": v for k, v in self._sched.counters.items()}
        return self._w().stats()

    # -- worker side -----------------------------------------------------------------------------
    def wants_shared_kv_cache(self) -> bool:
        return self._w().wants_shared_kv_cache()

    def register_kv_caches(self, kv_caches: Any, layout: KVCacheLayout) -> None:
        self._w().register(kv_caches, layout)

    def handshake_metadata(self) -> Any:
        return self._w().handshake_metadata()

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        self._w().start(meta)

    def wait_for_layer_load(self, layer: int) -> None:
        return None  # loads are asynchronous: they finish between steps

    def save_kv_layer(self, layer: int, kv_layer: Any, meta: KVConnectorMetadata) -> None:
        return None  # the producer is read in place, under a lease

    def wait_for_save(self) -> None:
        return None

    def get_finished(self) -> tuple[set[str], set[str]]:
        return self._w().get_finished()

    def get_failed_blocks(self) -> set[int]:
        return self._w().get_failed_blocks()

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self._w().set_wakeup(wake)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
