"""connectors/ec: the P2P encoder-cache connector "p2p_ec" (contract: pdcluster/engine/ec_connector.py).

    connector.py   P2PECConnector: the contract's two sides over the parts below
    options.py     ECOptions (ec_connector_options, checked)
    wire.py        msgpack schemas of the CURVE control plane, the compatibility fingerprint
    item_store.py  ItemStore: item states, leases, LRU eviction, the region's free space
    producer.py    ECProducer: region + TransferServer + pure request -> reply logic
    server.py      ECControlServer: the CURVE ROUTER thread (ZAP allow-list) and the expiry scan
    fetcher.py     ECFetcher: the consumer: NOT_READY retries, shm/TCP reads, digest check
"""

from __future__ import annotations

from .connector import P2PECConnector

__all__ = ["P2PECConnector"]
