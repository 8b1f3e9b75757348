"""prefill_worker: the producer side of disaggregated serving (answers the prefill leg).

Use `PrefillRole` as the `role` of `pdcluster.worker.server.start_worker_server`, or run
`python -m pdcluster.prefill_worker` (= `pdcluster serve-worker --role prefill`).

    role.py         PrefillRole: which legs it accepts and how it checks them (its admission rule)
    leg_checks.py   what a prefill leg may carry, refused by field name
    spec.py         ROLE: the prefill role for the worker core (the connector half it wires:
                    producer; its role metrics), registered in pdcluster.worker.role_registry
    __main__.py     the worker with this role fixed
"""

from __future__ import annotations

from pdcluster.prefill_worker.role import PrefillRole

__all__ = ["PrefillRole"]
