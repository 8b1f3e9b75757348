"""The prefill role as the worker core sees it (pdcluster.worker.role_registry)."""

from __future__ import annotations

from pdcluster.prefill_worker.role import PrefillRole
from pdcluster.worker.role_registry import WorkerRole

ROLE = WorkerRole(
    "prefill", PrefillRole, kv_role="producer", needs_connector=True,
    summary="the producer: computes prompts' KV and holds it under a lease for a decode worker",
    # Its work is prefill: queued prompts, and the KV it holds for decode legs still to read it.
    metrics=("num_running", "num_waiting", "num_held_for_transfer", "kv_connector"))
