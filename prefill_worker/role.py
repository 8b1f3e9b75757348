"""PrefillRole: the producer. It serves the prefill leg of a disaggregated request: compute the
prompt's KV, keep the blocks under a lease (the connector's request_finished says delay_free)
and return the first token plus the kv_transfer_params the decode leg needs.

The lease and the params themselves come from the engine's KV connector; the role checks the leg
is one this worker can produce (leg_checks.py: nothing of a decode leg's input on it) and passes
the router's request through. The wiring around it (connector half, metrics) is spec.py.
"""

from __future__ import annotations

from pdcluster.engine.kv_connector import KVTransferParams
from pdcluster.prefill_worker.leg_checks import check_producer_leg
from pdcluster.worker.roles import RoleHandler


class PrefillRole(RoleHandler):
    name = "prefill"

    def accept_producer_leg(self, kv: KVTransferParams) -> KVTransferParams:
        # The router asks for exactly one token on this leg (DESIGN.md section 3); more would
        # only be thrown away, but it is not wrong, so it is not refused here.
        check_producer_leg(kv)
        return kv
