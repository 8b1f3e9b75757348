"""P2PECConnector ("p2p_ec"): encoder outputs shared peer to peer (engine/ec_connector.py contract).

    producer (role both|producer)   ECProducer: ItemStore over a shared-memory Region registered
                                    with a TransferServer; ECControlServer: CURVE ROUTER + ZAP
    consumer (role both|consumer)   ECFetcher: CURVE DEALER per load, shm or TCP reads, digest check

One instance serves both sides of one engine. The consumer accepts a producer named by request data
only if its CURVE key is one of the cluster's (allowed_keys), and the producer checks the
compatibility fingerprint on every fetch.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

from pdcluster.config import EngineConfig
from pdcluster.engine.ec_connector import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECItemLoad,
    ECItemState,
    ECLoadReport,
    done_future,
)
from pdcluster.engine.ec_transfer_params import ECItemRef, ECTransferParams

from .fetcher import ECFetcher
from .options import ECOptions
from .producer import ECProducer
from .server import ECControlServer
from .wire import engine_fingerprint

log = logging.getLogger(__name__)


def _row_bytes(engine_config: EngineConfig) -> int:
    """Bytes of one encoder-output row here: a producer's item of any other size is refused unread."""
    from pdcluster.dtypes import ITEMSIZE
    from pdcluster.models.llava_config import load_llava_vision_config

    m = engine_config.model
    return load_llava_vision_config(m.model_path).text_hidden_size * ITEMSIZE[m.dtype]


class P2PECConnector(ECConnectorBase):
    name = "p2p_ec"

    def __init__(self, role: ECConnectorRole, engine_config: EngineConfig, options: dict[str, Any]) -> None:
        super().__init__(role, engine_config, options)
        self.opts = ECOptions.from_dict(options)
        self.fingerprint = engine_fingerprint(engine_config)
        self.is_producer = self.opts.is_producer
        self.producer: ECProducer | None = None
        self.server: ECControlServer | None = None
        self.fetcher: ECFetcher | None = None
        try:
            if self.is_producer:
                self.producer = ECProducer(self.opts, self.fingerprint)
                self.server = ECControlServer(self.producer, self.opts)
            if self.opts.role in ("both", "consumer"):
                self.fetcher = ECFetcher(self.opts, self.fingerprint, _row_bytes(engine_config))
        except BaseException:
            self.shutdown()
            raise

    # -- scheduler side ---------------------------------------------------------------------------
    def item_state(self, mm_hash: str) -> ECItemState:
        return self.producer.store.state(mm_hash) if self.producer is not None else ECItemState.ABSENT

    def reserve(self, mm_hashes: list[str]) -> None:
        if self.producer is not None:
            for h in mm_hashes:
                self.producer.store.reserve(h)

    def build_load_meta(self, request_id: str, features: list[Any],
                        params: tuple[ECTransferParams, ...]) -> ECConnectorMetadata:
        meta = ECConnectorMetadata(request_id)
        if self.fetcher is None:
            return meta
        seen: set[str] = set()
        for f in features:
            if f.mm_hash in seen:
                continue
            seen.add(f.mm_hash)
            for p in params:
                ref = p.item(f.mm_hash)
                if ref is not None and (not ref.num_tokens or ref.num_tokens == f.length):
                    meta.loads.append(ECItemLoad(f.mm_hash, f.length, p, ref))
                    break
        return meta

    def request_finished(self, request_id: str, mm_hashes: list[str]) -> ECTransferParams | None:
        if self.producer is None or self.server is None:
            return None
        held = self.producer.announce(list(dict.fromkeys(mm_hashes)))
        if not held:
            return None
        return ECTransferParams(
            connector=self.name, producer_id=self.opts.engine_id, address=self.server.address,
            public_key=self.opts.keypair.public, fingerprint=self.fingerprint, engine_epoch=self.producer.epoch,
            expires_at=time.time() + self.opts.lease_s,
            items=tuple(ECItemRef(h, lease_id, nbytes, num_tokens) for h, lease_id, nbytes, num_tokens in held))

    # -- worker side ------------------------------------------------------------------------------
    def save(self, mm_hash: str, output: Any) -> None:
        if self.producer is not None:
            self.producer.save(mm_hash, output)

    def start_load(self, meta: ECConnectorMetadata) -> Future[ECLoadReport]:
        if self.fetcher is None or not meta.loads:
            return done_future(ECLoadReport(meta.request_id))
        return self.fetcher.start(meta)

    def endpoint(self) -> tuple[str, bytes] | None:
        return (self.server.address, self.opts.keypair.public) if self.server is not None else None

    def get_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"transfer_bytes": 0}
        if self.fetcher is not None:
            out.update(self.fetcher.stats())
        if self.producer is not None:
            out.update(self.producer.stats())
        if self.server is not None:
            # Hostile or broken peers on the control port, as errors_<reason> (pdcluster_ec_errors_total).
            out["errors_control_handshake"] = int(self.server.refusals())
            for reason in ("malformed", "too_large", "replayed"):
                out[f"errors_control_{reason}"] = out.get(f"producer_refused_{reason}", 0)
            out["errors_data_refused"] = out.get("producer_data_refused", 0)  # its transfer server
        return out

    def shutdown(self) -> None:
        server, self.server = self.server, None
        producer, self.producer = self.producer, None
        fetcher, self.fetcher = self.fetcher, None
        for part in (server, producer, fetcher):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    log.exception("p2p_ec shutdown: closing %s failed", type(part).__name__)
