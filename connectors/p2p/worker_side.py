"""Worker side of the P2P connector: one transfer agent per worker rank.

    producer role: ProducerAgent (TransferServer over the whole registered cache + leases)
                   + SideChannelServer (CURVE ROUTER: handshake, open, heartbeat, done)
    consumer role: Loader (pulls leased blocks into this rank's cache, in background threads)
    both:          both

Loads are asynchronous (WAITING_FOR_REMOTE_KV): wait_for_layer_load and save_kv_layer have
nothing to do, because a producer keeps its blocks under a lease instead of copying them out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pdcluster.config import EngineConfig
from pdcluster.engine.kv_connector import KVCacheLayout, KVTransferParams
from pdcluster.handoff_trace import trace
from pdcluster.transfer import Region

from .agent import ProducerAgent
from .blocks import CacheGeometry
from .loader import Loader
from .options import P2POptions
from .scheduler_side import P2PMetadata
from .side_channel import SideChannelServer
from .wire import fingerprint

log = logging.getLogger(__name__)


class P2PWorker:
    def __init__(self, opts: P2POptions, engine_config: EngineConfig) -> None:
        self.opts = opts
        self.fingerprint = fingerprint(engine_config)
        self.agent: ProducerAgent | None = None
        self.side: SideChannelServer | None = None
        self.loader: Loader | None = None
        self._orphans: set[str] = set()  # loads this rank cannot run (no consumer role): failed at once
        self._orphan_blocks: set[int] = set()
        self._wake: Callable[[], None] = lambda: None

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """The engine's wake-up, called when a load (consumer) or a lease (producer) ends."""
        self._wake = wake
        self._hook()

    def _hook(self) -> None:
        if self.agent is not None:
            self.agent.leases.on_finished = self._wake
        if self.loader is not None:
            self.loader.on_finished = self._wake

    def wants_shared_kv_cache(self) -> bool:
        return self.opts.is_producer and self.opts.transport != "tcp"

    def register(self, kv_caches: Any, layout: KVCacheLayout) -> None:
        device = getattr(getattr(kv_caches, "device", None), "type", "cpu")
        if device != "cpu":
            raise NotImplementedError("the p2p connector moves CPU KV caches; a GPU cache needs a staging "
                                      "buffer (kernels/kv_pack.py), not implemented yet")
        geo = CacheGeometry(layout.num_layers, layout.num_blocks, layout.block_nbytes)
        region = Region.from_buffer(kv_caches)  # the runner's one contiguous (L, 2, N, bs, H, D) tensor
        if region.nbytes != geo.nbytes:
            raise ValueError(f"kv cache has {region.nbytes} bytes, layout says {geo.nbytes}")
        if self.opts.is_producer:
            shm_name = layout.shm_name if self.opts.transport != "tcp" else None
            self.agent = ProducerAgent(self.opts, self.fingerprint, geo, region, shm_name,
                                       layout.tp_rank, layout.tp_size, layout.total_heads)
            try:
                self.side = SideChannelServer(self.agent, self.opts)
            except BaseException:
                self.agent.close()
                raise
        if self.opts.is_consumer:
            self.loader = Loader(self.opts, self.fingerprint, geo, region.view, layout)
        self._hook()

    def handshake_metadata(self) -> dict[str, Any]:
        if self.agent is None or self.side is None:
            return {"producer_id": self.opts.engine_id}
        body = self.agent.body()
        return {"producer_id": self.opts.engine_id, "epoch": self.agent.epoch, "tp_size": body["tp_size"],
                "tp_rank": body["tp_rank"],
                "data_host": body["data_host"], "data_port": body["data_port"],
                "handshake_endpoint": self.side.endpoint, "public_key": self.opts.keypair.public}

    def start(self, meta: Any) -> None:
        if not isinstance(meta, P2PMetadata):
            return
        for request_id in meta.cancels:  # before loads: a reused request id never cancels its new load
            if self.loader is not None:
                self.loader.cancel(request_id)
        for lease in meta.leases:
            if self.agent is None:
                log.error("lease for %s but this rank has no producer agent", lease["request_id"])
                continue
            self.agent.add_lease(lease["request_id"], lease["transfer_id"], lease["lease_id"], lease["block_ids"])
            trace("p.lease", lease["request_id"])
        for load in meta.loads:
            if self.loader is None:
                self._orphans.add(load["request_id"])
                self._orphan_blocks.update(load["local_block_ids"])
                continue
            self.loader.submit(load["request_id"], load["local_block_ids"], load["first_block"],
                               KVTransferParams.from_wire(load["params"]))
        for request_id in meta.drops:
            if self.agent is not None:
                self.agent.leases.drop_request(request_id)
        for rel in meta.releases:
            if self.loader is not None:
                self.loader.release(rel["request_id"], KVTransferParams.from_wire(rel["params"]))

    def get_finished(self) -> tuple[set[str], set[str]]:
        sending = self.agent.leases.take_finished() if self.agent is not None else set()
        recving = self.loader.take_finished() if self.loader is not None else set()
        if self._orphans:
            recving |= self._orphans
            self._orphans = set()
        return sending, recving

    def get_failed_blocks(self) -> set[int]:
        failed = self.loader.take_failed_blocks() if self.loader is not None else set()
        if self._orphan_blocks:
            failed |= self._orphan_blocks
            self._orphan_blocks = set()
        return failed

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.agent is not None:
            out.update(self.agent.stats())
        if self.side is not None:
            out["p2p_side_channel_refusals"] = self.side.refusals()
        if self.loader is not None:
            out.update(self.loader.stats())
        return out

    def shutdown(self) -> None:
        if self.side is not None:
            self.side.close()
            self.side = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if self.loader is not None:
            self.loader.close()
            self.loader = None
