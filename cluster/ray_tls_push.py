"""Driver side of a TLS rotation under `pdcluster up`: after `keys rotate-ca` / `keys reissue` /
`keys revoke-ca` on --key-dir, the launcher (the foreground `up` on SIGHUP or when the CA files
change, or `pdcluster up --reload-keys` for a detached cluster) re-reads the CA and sends each
actor only its own new identity through Ray calls on the actor's handle (the actor rewrites
its files: ray_tls_update.py). Three phases, each sent to every actor and answered before the
next, so at no moment does one actor present a certificate another does not trust:

    1. trust   bundle := current bundle + the launcher's bundle (every CA trusted so far stays)
    2. reissue each actor its new certificate and key from the issuing CA (bundle still merged)
    3. prune   bundle := the launcher's bundle exactly (a revoked CA leaves every actor)

A phase with a failed actor stops the push there (phase 1: nothing but extra trust happened;
phase 2: old CAs stay trusted); `complete` says whether all three ran. A restarted actor comes
back with its start-up identity: `refresh()` sends it a current one (checked by issuer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdcluster.cluster.ray_tls import ENV_CA, LauncherTLS
from pdcluster.cluster.ray_tls_update import MERGE_CA

log = logging.getLogger("pdcluster.ray")

# (role, name) of each actor -> its update; returns per actor its answer or the exception.
Send = Callable[[Mapping[tuple[str, str], Mapping[str, str]]], Mapping[tuple[str, str], Any]]


def push_rotation(tls: LauncherTLS, actors: Sequence[tuple[str, str]], send: Send) -> dict[str, Any]:
    """Run the three phases over `actors` ((role, name) pairs); a report per phase and actor."""
    report: dict[str, Any] = {"complete": False, "phases": {}, "serials": {}}
    trust = {a: {ENV_CA: tls.bundle, MERGE_CA: "1"} for a in actors}
    reissue = {a: {**tls.identity_env(*a), ENV_CA: tls.bundle, MERGE_CA: "1"} for a in actors}
    prune = {a: {ENV_CA: tls.bundle} for a in actors}
    for phase, updates in (("trust", trust), ("reissue", reissue), ("prune", prune)):
        answers = send(updates)
        failed = {_label(a): f"{type(r).__name__}: {r}" for a, r in answers.items() if isinstance(r, BaseException)}
        missing = [_label(a) for a in updates if a not in answers]
        failed.update({m: "no answer" for m in missing})
        report["phases"][phase] = {"ok": len(updates) - len(failed), "failed": failed}
        if phase == "reissue":
            report["serials"] = {_label(a): r["serial"] for a, r in answers.items() if isinstance(r, Mapping)}
        if failed:
            log.warning("TLS rotation stopped at %s: %s", phase, failed)
            return report
    report["complete"] = True
    return report


def refresh(tls: LauncherTLS, actors: Sequence[tuple[str, str]], send: Send) -> dict[str, str]:
    """Actors whose certificate is not from the issuing CA (restarted after a CA rotation: they
    wrote their start-up identity and bundle) get a current identity and exactly the current
    bundle; returns label -> new serial."""
    answers = send({a: {} for a in actors})
    stale = [a for a, r in answers.items() if isinstance(r, Mapping) and r.get("issuer") != tls.issuer]
    if not stale:
        return {}
    fixed = send({a: {**tls.identity_env(*a), ENV_CA: tls.bundle} for a in stale})
    for a, r in fixed.items():
        if isinstance(r, BaseException):
            log.warning("TLS: %s has an outdated identity and refused the current one: %s", _label(a), r)
    return {_label(a): r["serial"] for a, r in fixed.items() if isinstance(r, Mapping)}


def _label(actor: tuple[str, str]) -> str:
    return actor[1]


def ray_send(namespace: str, timeout_s: float = 30.0) -> Send:
    """Send updates through Ray to the actors NAMESPACE:NAME (worker instances, the router)."""
    def send(updates: Mapping[tuple[str, str], Mapping[str, str]]) -> dict[tuple[str, str], Any]:
        import ray

        refs: dict[tuple[str, str], Any] = {}
        out: dict[tuple[str, str], Any] = {}
        for actor, update in updates.items():
            try:
                handle = ray.get_actor(f"{namespace}:{actor[1]}", namespace=namespace)
                refs[actor] = handle.update_tls.remote(dict(update))
            except Exception as e:  # gone, or restarting
                out[actor] = e
        for actor, ref in refs.items():
            try:
                out[actor] = ray.get(ref, timeout=timeout_s)
            except Exception as e:
                out[actor] = e
        return out

    return send


def cluster_actors(namespace: str) -> list[tuple[str, str]]:
    """(role, name) of every actor of the namespace: the router and the worker instances."""
    from pdcluster.cluster.ray_teardown import named_actors

    names = [n.split(":", 1)[1] for n in named_actors(namespace)]
    return [("router" if n == "router" else "worker", n) for n in names]


def reload_cluster_tls(namespace: str, key_dir: str | None) -> dict[str, Any]:
    """`pdcluster up --reload-keys`: the push from a process other than the `up` that started the
    cluster (a detached one). Needs the CA on disk: an in-memory CA went with its `up`."""
    tls = LauncherTLS(key_dir)
    if tls.key_dir is None:
        raise ValueError(f"no CA key in {key_dir!r}/tls: a cluster started without --key-dir had its CA in the "
                         "memory of its `up` process; only that process can reissue (SIGHUP it)" if key_dir else
                         "give --key-dir (the cluster's `pdcluster keys init` folder): its CA issues the new identities")
    tls.reload()  # checks a rotation is not half written
    return push_rotation(tls, cluster_actors(namespace), ray_send(namespace))
