"""The encode role as the worker core sees it (pdcluster.worker.role_registry)."""

from __future__ import annotations

from pdcluster.encode_worker.role import EncodeRole
from pdcluster.worker.role_registry import WorkerRole

ROLE = WorkerRole(
    "encode", EncodeRole, kv_role="both", encoder_only=True, default_ec_connector="p2p_ec", ec_role="producer",
    summary="encoder-only: runs the vision tower + projector and holds the outputs for prefill/decode legs",
    # Its work is encoding: images computed, served from its cache, fetched by others; EC errors.
    metrics=("num_running", "num_waiting", "ec_connector"))
