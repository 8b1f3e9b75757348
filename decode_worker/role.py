"""DecodeRole: the consumer. It serves the decode leg: the request carries what the prefill leg
returned (producer id, epoch, blocks or store keys, lease); the engine allocates blocks, the
connector pulls the KV (WAITING_FOR_REMOTE_KV), then the engine decodes and streams.

Trust (DESIGN.md section 6): peer addresses in the params came through the router; the
connector resolves producer_id against its own registry/handshake before opening anything.
"""

from __future__ import annotations

from pdcluster.engine.kv_connector import KVTransferParams
from pdcluster.worker.roles import RoleHandler, check_consumer_params


class DecodeRole(RoleHandler):
    name = "decode"

    def accept_consumer_leg(self, kv: KVTransferParams) -> KVTransferParams:
        return check_consumer_params(kv)
