"""pdcluster.connectors.p2p: the peer-to-peer KV connector (registry name "p2p")."""

from __future__ import annotations

from .connector import P2PConnector
from .options import P2POptions

__all__ = ["P2PConnector", "P2POptions"]
