"""decode_worker: the consumer side of disaggregated serving (takes kv_transfer_params from
the prefill leg, loads the KV, decodes).

Use `DecodeRole` as the `role` of `pdcluster.worker.server.start_worker_server`, or run
`pdcluster serve-worker --role decode`.
"""

from __future__ import annotations

from pdcluster.decode_worker.role import DecodeRole

__all__ = ["DecodeRole"]
