"""The decode role as the worker core sees it (pdcluster.worker.role_registry)."""

from __future__ import annotations

from pdcluster.decode_worker.role import DecodeRole
from pdcluster.worker.role_registry import WorkerRole

ROLE = WorkerRole(
    "decode", DecodeRole, kv_role="consumer", needs_connector=True, ec_role="consumer",
    summary="the consumer: loads the KV a prefill worker produced, then decodes and streams",
    # Its work is decode: running sequences, and those still waiting for their KV to arrive.
    metrics=("num_running", "num_waiting", "num_waiting_for_remote_kv", "kv_connector"))
