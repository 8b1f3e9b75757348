"""`pdcluster status`: what runs where, and how it is doing.

Sources, each optional so a half-broken cluster still gets a report:
- the worker actors (describe(): address, node, child pid) and Ray's state API (restarts, state);
- the router's ListWorkers over gRPC (health, running/waiting requests, KV-cache usage, the EC
  producer endpoint of workers that hold encoder outputs for others), falling
  back to asking the router actor when its gRPC port is not reachable from here.
"""

from __future__ import annotations

from typing import Any

from pdcluster.cluster.ray_teardown import named_actors

_TIMEOUT_S = 10.0


def collect_status(namespace: str) -> dict[str, Any]:
    import ray

    names = named_actors(namespace)
    router_name = f"{namespace}:router"
    out: dict[str, Any] = {"namespace": namespace, "router": None, "instances": [], "errors": []}
    if router_name in names:
        router = ray.get_actor(router_name, namespace=namespace)
        try:
            out["router"] = ray.get(router.endpoints.remote(), timeout=_TIMEOUT_S)
        except Exception as e:
            out["errors"].append(f"router: {e}")
    load = _router_load(out["router"], namespace, out["errors"])
    actors = _actor_states(namespace)
    if out["router"] is not None:  # a restarted router may be on new ports if its old ones were taken
        out["router"] = {**out["router"], **actors.get(router_name, {})}
    nodes = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
    for name in names:
        if name == router_name:
            continue
        entry: dict[str, Any] = {"name": name.split(":", 1)[1], **actors.get(name, {})}
        try:
            w = ray.get(ray.get_actor(name, namespace=namespace).describe.remote(), timeout=_TIMEOUT_S)
            entry.update({k: w.get(k) for k in ("address", "role", "node_id", "child_pid", "ready")})
        except Exception as e:  # restarting or dead: Ray's state still says which
            entry["error"] = str(e).splitlines()[0]
        entry["node"] = nodes.get(entry.get("node_id") or "", "")
        entry.update(load.get(entry.get("address") or "", {"healthy": False}))
        out["instances"].append(entry)
    return out


def _router_load(endpoints: dict[str, Any] | None, namespace: str, errors: list[str]) -> dict[str, dict]:
    if not endpoints:
        return {}
    try:
        from pdcluster.client import Client

        with Client(endpoints["grpc"], timeout=_TIMEOUT_S) as client:
            entries = client.list_workers()
        return {e.address: {"healthy": e.healthy, "num_inflight": e.num_inflight,
                            "num_running": e.stats.num_running, "num_waiting": e.stats.num_waiting,
                            "kv_usage": e.stats.kv_usage, "ec_endpoint": e.ec_endpoint or None} for e in entries}
    except Exception as e:  # not reachable from this machine: ask the actor instead
        errors.append(f"router ListWorkers at {endpoints.get('grpc')}: {type(e).__name__}")
    import ray

    router = ray.get_actor(f"{namespace}:router", namespace=namespace)
    return {w["address"]: w for w in ray.get(router.workers.remote(), timeout=_TIMEOUT_S)}


def _actor_states(namespace: str, attempts: int = 5) -> dict[str, dict[str, Any]]:
    """name -> {state, restarts} from Ray's state API (served by the dashboard). Right after an
    actor restarts the API can fail for a moment, so a failure is retried before restarts are
    reported unknown ({})."""
    import time

    for attempt in range(attempts):
        try:
            from ray.util.state import list_actors

            rows = list_actors(filters=[("ray_namespace", "=", namespace)], detail=True, limit=10_000)
            break
        except Exception:  # no dashboard (state API) yet, or none at all
            if attempt == attempts - 1:
                return {}
            time.sleep(1.0)
    return {r.name: {"state": r.state, "restarts": r.num_restarts} for r in rows if r.name and r.state != "DEAD"}


def format_status(s: dict[str, Any]) -> str:
    lines = []
    r = s.get("router")
    if r:
        lines.append(f"pdcluster {s['namespace']}: router gRPC {r.get('grpc')}"
                     + (f", HTTP {r['http']}" if r.get("http") else "") + f", policy {r.get('policy')}"
                     + (f", restarts {r['restarts']}" if r.get("restarts") else "")
                     + ("" if r.get("serving", True) else " (restarting: not serving yet)"))
    else:
        lines.append(f"pdcluster {s['namespace']}: no router")
    if not s["instances"]:
        lines.append("  no worker instances")
    else:
        lines.append(f"  {'INSTANCE':<12} {'ROLE':<8} {'NODE':<16} {'ADDRESS':<22} {'HEALTH':<8} "
                     f"{'RUN':>4} {'WAIT':>4} {'KV%':>6} {'RESTARTS':>8}  PID")
        for i in s["instances"]:
            kv = i.get("kv_usage")
            lines.append(
                f"  {i['name']:<12} {i.get('role') or '?':<8} {i.get('node') or '?':<16} {i.get('address') or '?':<22} "
                f"{'ok' if i.get('healthy') else 'DOWN':<8} {_n(i.get('num_running')):>4} {_n(i.get('num_waiting')):>4} "
                f"{'-' if kv is None else f'{100 * kv:.1f}':>6} {_n(i.get('restarts')):>8}  {_n(i.get('child_pid'))}"
                + (f"  ec {i['ec_endpoint']}" if i.get("ec_endpoint") else "")
                + (f"  ({i['error']})" if i.get("error") else ""))
    lines += [f"  ! {e}" for e in s.get("errors", [])]
    return "\n".join(lines)


def _n(v: Any) -> str:
    return "-" if v is None else str(v)
