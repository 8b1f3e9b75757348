"""decode_worker: the consumer side of disaggregated serving (takes kv_transfer_params from
the prefill leg, loads the KV, decodes).

Use `DecodeRole` as the `role` of `pdcluster.worker.server.start_worker_server`, or run
`python -m pdcluster.decode_worker` (= `pdcluster serve-worker --role decode`).

    role.py         DecodeRole: which legs it accepts and how it checks them (its admission rule)
    spec.py         ROLE: the decode role for the worker core (the connector half it wires:
                    consumer; its role metrics), registered in pdcluster.worker.role_registry
    __main__.py     the worker with this role fixed
"""

from __future__ import annotations

from pdcluster.decode_worker.role import DecodeRole

__all__ = ["DecodeRole"]
