"""What a restarted RouterActor incarnation needs to resume (cluster/ray_actors.py): whether this is a
restart, and the ports it bound, kept in Ray's internal KV (GCS), which outlives the actor's
process but not the cluster."""

from __future__ import annotations

import json
import warnings
from typing import Any


def reconstructed() -> bool:
    import ray

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the property itself reads Ray's deprecated actor_id
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _kv_key(spec: dict[str, Any]) -> bytes:
    return f"pdcluster:{spec.get('namespace', '')}:{spec.get('name', 'router')}:ports".encode()


def remember_ports(spec: dict[str, Any], value: dict[str, Any]) -> None:
    """The router's bound ports (and key folder) in Ray's GCS, for a restarted incarnation."""
    from ray.experimental import internal_kv

    if spec.get("namespace"):
        internal_kv._internal_kv_put(_kv_key(spec), json.dumps(value).encode(), overwrite=True)


def forget_ports(spec: dict[str, Any]) -> None:
    """A stopped router is not to be resumed."""
    from ray.experimental import internal_kv

    if spec.get("namespace"):
        internal_kv._internal_kv_del(_kv_key(spec))


def recall_ports(spec: dict[str, Any]) -> dict[str, Any] | None:
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_kv_key(spec)) if spec.get("namespace") else None
    return json.loads(raw) if raw else None
