"""Take a pdcluster on Ray down: nothing of it left running.

    router.drain_workers(drain_timeout_s)
                    Worker.Drain on every worker at once, through the router (the one identity
                    allowed to call it): no new requests, running ones finish and stream out
                    through the still running router until the timeout, the rest end UNAVAILABLE
    router.stop()   (frontends closed, worker channels closed)
    worker.stop()   each actor SIGTERMs its serve-worker child by pid, SIGKILL after a grace period
    ray.kill        every actor of the namespace, no restart (a child whose actor dies this way gets
                    SIGTERM from PDEATHSIG)
    placement groups of the namespace removed
    ray.shutdown(); the local head `up` started (if any) SIGTERMed by its recorded pid

Works on what Ray reports for the namespace, so it also cleans up after an `up` that failed
half-way or a launcher that was killed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pdcluster.cluster import ray_head

DEFAULT_DRAIN_TIMEOUT_S = 10.0  # serve-worker's --drain-timeout default
DRAIN_RPC_MARGIN_S = 30.0  # beyond the drain itself: the RPC's and Ray's own latency

log = logging.getLogger("pdcluster.ray")


def named_actors(namespace: str) -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == namespace and a["name"].startswith(f"{namespace}:"))


def teardown(namespace: str, *, head: ray_head.LocalHead | None = None, grace_s: float = 10.0,
             shutdown: bool = True, namespace_too: bool = True,
             drain_timeout_s: float | None = DEFAULT_DRAIN_TIMEOUT_S) -> dict[str, Any]:
    """Stop everything of `namespace`; returns what was stopped and anything left over.
    shutdown: disconnect from Ray afterwards (always when `head` is given: it goes away);
    namespace_too=False: only the head and the connection (nothing in the namespace is ours);
    drain_timeout_s: how long the workers' in-flight requests may run on (None: no drain)."""
    import ray

    report: dict[str, Any] = {"actors": [], "placement_groups": [], "children": {}, "left": [], "drained": {}}
    if ray.is_initialized():
        try:
            if namespace_too:
                _stop_actors(namespace, grace_s, report, drain_timeout_s)
                _remove_groups(namespace, report)
        finally:
            if shutdown or head is not None:
                ray.shutdown()
    if head is not None and not ray_head.stop_local_head(head.pid, start_time=head.start_time):
        report["left"].append(f"Ray head pid {head.pid}")
    report["head_stopped"] = head is not None
    return report


def _stop_actors(namespace: str, grace_s: float, report: dict[str, Any], drain_timeout_s: float | None) -> None:
    import ray

    names = named_actors(namespace)
    handles = {}
    for name in names:
        try:
            handles[name] = ray.get_actor(name, namespace=namespace)
        except ValueError:  # gone meanwhile
            continue
    router = handles.pop(f"{namespace}:router", None)
    if router is not None and drain_timeout_s is not None:
        drained = _call(router.drain_workers.remote(drain_timeout_s), drain_timeout_s + 2 * DRAIN_RPC_MARGIN_S,
                        "router.drain_workers")
        report["drained"] = drained or {}
    if router is not None:
        _call(router.stop.remote(), 15.0, "router.stop")
    stops = {name: a.stop.remote(grace_s) for name, a in handles.items()}
    for name, ref in stops.items():
        out = _call(ref, grace_s + 10.0, f"{name}.stop")
        if out:
            report["children"][name] = out
    for name, actor in [*handles.items(), *([(f"{namespace}:router", router)] if router else [])]:
        ray.kill(actor, no_restart=True)
        report["actors"].append(name)
    deadline = time.monotonic() + 30.0
    while named_actors(namespace) and time.monotonic() < deadline:
        time.sleep(0.2)  # a killed actor's name is released once Ray has marked it dead
    report["left"] += [f"actor {n}" for n in named_actors(namespace)]


def _call(ref: Any, timeout_s: float, what: str) -> Any:
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except Exception as e:  # a dead or stuck actor: ray.kill follows, PDEATHSIG takes its child
        log.warning("%s failed: %s", what, e)
        return None


def _remove_groups(namespace: str, report: dict[str, Any]) -> None:
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    prefix = f"{namespace}:"
    for pg_id, t in placement_group_table().items():
        name = str(t.get("name", ""))
        if not name.startswith(prefix) or t.get("state") == "REMOVED":
            continue
        try:
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
            report["placement_groups"].append(name)
        except (ValueError, ray.exceptions.RaySystemError) as e:
            report["left"].append(f"placement group {name} ({e})")
