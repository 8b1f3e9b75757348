"""Producer and consumer halves of the p2p_ec connector without an engine (real sockets on
127.0.0.1, real CURVE keys), for the control- and data-plane tests."""

from __future__ import annotations

from typing import Any

from pdcluster.connectors.ec.fetcher import ECFetcher
from pdcluster.connectors.ec.options import ECOptions
from pdcluster.connectors.ec.producer import ECProducer
from pdcluster.connectors.ec.server import ECControlServer
from pdcluster.engine.ec_connector import ECConnectorMetadata, ECItemLoad, ECLoadReport
from pdcluster.engine.ec_transfer_params import ECItemRef, ECTransferParams

FP = "ab" * 32


class Producer:
    def __init__(self, keys: Any, fingerprint: str = FP, **opts: Any) -> None:
        self.opts = ECOptions.from_dict(keys.options("encoder", role="producer", **opts))
        self.producer = ECProducer(self.opts, fingerprint)
        self.server = ECControlServer(self.producer, self.opts)
        self.store = self.producer.store

    def params(self, items: list[tuple[str, str]] = (), fingerprint: str = FP) -> ECTransferParams:
        return ECTransferParams(connector="p2p_ec", address=self.server.address, public_key=self.opts.keypair.public,
                                fingerprint=fingerprint, items=tuple(ECItemRef(h, lease) for h, lease in items))

    def close(self) -> None:
        self.server.close()
        self.producer.close()


def consumer(keys: Any, name: str = "prefill", fingerprint: str = FP, row_bytes: int | None = None,
             **opts: Any) -> ECFetcher:
    return ECFetcher(ECOptions.from_dict(keys.options(name, role="consumer", **opts)), fingerprint, row_bytes)


def fetch(fetcher: ECFetcher, params: ECTransferParams, wanted: list[tuple[str, int]]) -> ECLoadReport:
    meta = ECConnectorMetadata("r1", [ECItemLoad(h, n, params, params.item(h) or ECItemRef(h)) for h, n in wanted])
    return fetcher.start(meta).result(timeout=60)
