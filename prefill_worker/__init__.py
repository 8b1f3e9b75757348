"""prefill_worker: the producer side of disaggregated serving (answers the prefill leg).

Use `PrefillRole` as the `role` of `pdcluster.worker.server.start_worker_server`, or run
`pdcluster serve-worker --role prefill`.
"""

from __future__ import annotations

from pdcluster.prefill_worker.role import PrefillRole

__all__ = ["PrefillRole"]
