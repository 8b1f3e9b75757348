"""EncodeRole: the encoder-only instance. It answers Worker.Encode (the servicer runs
AsyncEngine.encode and returns the EcTransferParams its EC producer now holds) and refuses every
Generate: its engine has the vision tower and projector only, no decoder and no KV cache, so a
generate sent here is a routing mistake the router can correct (FAILED_PRECONDITION), not a bad
request (INVALID_ARGUMENT).
"""

from __future__ import annotations

from pdcluster.engine.kv_connector import KVTransferParams
from pdcluster.worker.roles import KvTransferRejected, RoleHandler

_WHY = ("an encode worker runs only the vision encoder (Worker.Encode); send Generate to a prefill, "
        "decode or aggregated worker")


class EncodeRole(RoleHandler):
    name = "encode"

    def accept(self, kv: KVTransferParams | None) -> KVTransferParams | None:
        raise KvTransferRejected(_WHY)
