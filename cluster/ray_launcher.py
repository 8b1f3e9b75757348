"""RayLauncher: bring a pdcluster up on Ray (local or existing cluster) and take it down again.

    launcher = RayLauncher(config, address="local")   # "local" | "auto" | "ray://..." | "HOST:PORT"
    endpoints = launcher.up()        # raises LaunchError naming every part that did not come up
    ...
    launcher.down()                  # actors, placement groups, the local head it started

Order of `up`, each step checked before the next, everything undone on failure:

    preflight (config vs serve-worker flags, keys)  -> plan on the nodes (placement.py)
    [local: start a loopback Ray head]              -> ray.init(namespace)
    one STRICT_PACK placement group per instance    -> wait placed
    one WorkerActor per instance in its group       -> wait PDCLUSTER_READY from every one
    RouterActor on this node with the workers       -> wait until every worker is healthy
                                                       (restarted by Ray like the workers)

Actors and groups are named `NAMESPACE:...` in Ray namespace NAMESPACE so `status`/`down` in
another process find them; with detach=True they are detached and outlive this process.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import asdict
from typing import Any

from pdcluster.cluster import ray_head
from pdcluster.cluster.config import ClusterConfig, ConfigError
from pdcluster.cluster.cpu_pinning import ENV_THREADS
from pdcluster.cluster.placement import InstancePlan, NodeInfo, plan_placement
from pdcluster.cluster.ray_secrets import ENV_CONNECTOR_OPTIONS, cluster_secrets
from pdcluster.cluster.worker_flags import engine_argv, worker_flag, worker_flag_actions

log = logging.getLogger("pdcluster.ray")
ROUTER = "router"


class LaunchError(RuntimeError):
    """Some part of the cluster did not come up; the message says which and why."""


def actor_name(namespace: str, name: str) -> str:
    return f"{namespace}:{name}"


class RayLauncher:
    def __init__(self, config: ClusterConfig, *, address: str = "local", detach: bool = False,
                 insecure: bool = False, insecure_internal: bool = False, worker_threads: str = "0",
                 disagg_mode: str = "sequential") -> None:
        self.config = config
        self.worker_threads = worker_threads  # `serve --worker-threads`: auto, 0 (torch's default) or N
        self.disagg_mode = disagg_mode  # the router's --disagg-mode (RouterConfig.disagg_mode)
        self._nodes: dict[str, NodeInfo] = {}
        self.threads: dict[str, int] = {}  # instance name -> torch threads per TP rank (worker_threads)
        self.address = address
        self.detach = detach
        self.insecure = insecure  # the router may bind a non-loopback host without TLS or a key
        # Router <-> worker gRPC in plaintext instead of mutual TLS (cluster/ray_tls.py).
        self.insecure_internal = insecure_internal
        self.tls: Any = None  # ray_tls.LauncherTLS: the CA that issues each actor its identity
        self.tls_rotations = 0  # pushes done (reload_tls): restarted actors then need refresh_tls
        self._secrets: Any = None  # ray_secrets.ClusterSecrets
        self.ns = config.namespace
        self.head: ray_head.LocalHead | None = None
        self.workers: dict[str, Any] = {}   # instance name -> actor handle
        self.groups: list[Any] = []
        self.router: Any = None
        self.ready: dict[str, dict] = {}     # instance name -> WorkerActor.describe()
        self.endpoints: dict[str, Any] = {}
        self._key_tmp: str | None = None
        self._owns_ray = False
        self._claimed = False  # the namespace was found empty: everything in it is ours to stop

    # -- up -------------------------------------------------------------------------------------
    def up(self) -> dict[str, Any]:
        worker_env, router_env = self._preflight()
        steps: dict[str, float] = {}
        t0 = time.monotonic()
        try:
            plans = self._connect()
            steps["ray_s"] = time.monotonic() - t0
            log.info("Ray at %s: %d node(s); placing %d instance(s)", self._reconnect_address(), len(set(
                p.node_id for p in plans)), len(plans))
            self._create_groups(plans)
            steps["placement_groups_s"] = time.monotonic() - t0 - sum(steps.values())
            self._create_workers(plans, worker_env)
            self._create_router(router_env)  # its process starts while the engines load
            self._wait_workers()
            steps["workers_s"] = time.monotonic() - t0 - sum(steps.values())
            log.info("%d worker(s) serving; starting the router", len(self.ready))
            self._start_router()
            steps["router_s"] = time.monotonic() - t0 - sum(steps.values())
        except BaseException:
            self.down()
            raise
        self.endpoints["startup_s"] = {k: round(v, 2) for k, v in steps.items()}
        ray_head.write_state(self.ns, self._state())
        return self.endpoints

    def _preflight(self) -> tuple[dict[str, str], dict[str, str]]:
        """Everything that can fail without a cluster fails here, before anything starts."""
        actions = worker_flag_actions()
        for role, pool in self.config.pools.items():
            if pool.tp > 1 and worker_flag(actions, "tp") is None:
                raise ConfigError(f"pools.{role}.tp: serve-worker has no tensor-parallel flag yet")
        conn = self.config.connector
        if conn is not None and worker_flag(actions, "connector") is None:
            raise ConfigError(f"connector.name: serve-worker has no --kv-connector flag yet, so connector "
                              f"{conn.name!r} cannot be passed to the workers")
        if conn is not None and not _worker_reads_connector_env():
            raise ConfigError(f"connector.options: serve-worker does not read ${ENV_CONNECTOR_OPTIONS} yet")
        existing = ray_head.read_state(self.ns)
        if existing and existing.get("head_pid") and ray_head.pid_alive(existing["head_pid"], existing.get("head_start", 0)):
            raise LaunchError(f"a pdcluster is already up in namespace {self.ns!r} (state {ray_head.state_path(self.ns)}); "
                              "run `pdcluster down` first or pick another --namespace")
        found = cluster_secrets(self.config)
        self._key_tmp = found.key_dir
        self._secrets = found
        if not self.insecure_internal:
            from pdcluster.cluster.ray_tls import LauncherTLS

            self.tls = LauncherTLS(self.config.key_dir)
            log.info("internal gRPC: mutual TLS, certificates from %s", self.tls.source)
            return found.worker_env, {**found.router_env, **self.tls.router_env()}
        return found.worker_env, found.router_env

    def _connect(self) -> list[InstancePlan]:
        if self.address == "local":
            local = self._local_node()
            plan_placement(self.config, [local])  # a config that cannot fit fails before the head starts
            log.info("starting a local Ray head (%g CPU)", local.resources["CPU"])
            self.head = ray_head.start_local_head(
                num_cpus=self.config.num_cpus, resources={k: v for k, v in local.resources.items() if k != "CPU"},
                labels=local.labels, log_path=ray_head.state_dir() / f"{self.ns}-head.log", detach=self.detach,
                dashboard=self.config.dashboard)
            # Record the head at once: a `down` from another shell must find it even if `up` fails later.
            ray_head.write_state(self.ns, self._state())
            address = self.head.address
        else:
            address = self.address
            if not ray_head.gcs_reachable(address):  # ray.init would retry a dead address for minutes
                raise LaunchError(f"no Ray cluster answers at {address!r}")
        with ray_head.driver_env(self.head.env if self.head else {}):  # scoped: Ray reads it at import/init
            import ray

            if not ray.is_initialized():  # a caller already connected (tests, notebooks) keeps its connection
                ray.init(address=address, namespace=self.ns, log_to_driver=not self.detach, configure_logging=False)
                self._owns_ray = True
        existing = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["namespace"] == self.ns and a["name"].startswith(f"{self.ns}:")]
        if existing:
            raise LaunchError(f"namespace {self.ns!r} already has pdcluster actors {[a['name'] for a in existing]}; "
                              "run `pdcluster down` first or pick another --namespace")
        self._claimed = True
        nodes = [NodeInfo.from_ray(n) for n in ray.nodes()]
        self._nodes = {n.node_id: n for n in nodes}
        return plan_placement(self.config, nodes)

    def _local_node(self) -> NodeInfo:
        """The one node of a local cluster: this machine's CPUs plus every resource and label the
        pools ask for, so a config written for a multi-node cluster also runs on a laptop."""
        resources: dict[str, float] = {"CPU": float(self.config.num_cpus or os.cpu_count() or 1)}
        labels: dict[str, str] = {}
        for pool in self.config.pools.values():
            if pool.placement.resource:
                resources[pool.placement.resource] = 1.0
            if pool.placement.label:
                labels[pool.placement.label[0]] = pool.placement.label[1]
        return NodeInfo("local", "127.0.0.1", resources, None, labels)

    def _create_groups(self, plans: list[InstancePlan]) -> None:
        import ray
        from ray.util.placement_group import placement_group

        for p in plans:
            kwargs: dict[str, Any] = {"name": actor_name(self.ns, p.name), "strategy": "STRICT_PACK",
                                      "lifetime": "detached" if self.detach else None}
            if self.head is None and len(ray.nodes()) > 1:
                kwargs["_soft_target_node_id"] = p.node_id  # spread/pack preference; see placement.py
            if p.label_selector:
                kwargs["bundle_label_selector"] = [dict(p.label_selector) for _ in p.bundles]
            self.groups.append(placement_group([dict(b) for b in p.bundles], **kwargs))
        timeout = self.config.ready_timeout_s
        refs = [g.ready() for g in self.groups]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            stuck = [f"  {p.name}: bundle {dict(p.bundles[0])}" for p, r in zip(plans, refs) if r in pending]
            raise LaunchError(f"{len(pending)} placement group(s) not placed within {timeout:g}s "
                              f"(resources taken by something else?):\n" + "\n".join(stuck))

    def _create_workers(self, plans: list[InstancePlan], env: dict[str, str]) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pdcluster.cluster.ray_actors import WorkerActor

        cls = ray.remote(WorkerActor)
        self.threads = worker_threads(self.config, plans, self._nodes, self.worker_threads)
        if self.threads:
            log.info("workers: torch threads per TP rank %s (--worker-threads %s)", self.threads, self.worker_threads)
        host = "127.0.0.1" if self.head is not None and self.config.worker_host == "auto" else self.config.worker_host
        for plan, group in zip(plans, self.groups):
            pool = self.config.pools[plan.pool]
            bundle = dict(plan.bundles[0])
            spec = {"name": plan.name, "argv": _worker_argv(self.config, plan.pool),
                    "host": "node_ip" if host == "auto" else host, "log_dir": self.config.log_dir,
                    "ready_timeout_s": self.config.ready_timeout_s,
                    "router_name": actor_name(self.ns, ROUTER), "namespace": self.ns}
            self.workers[plan.name] = cls.options(
                name=actor_name(self.ns, plan.name), namespace=self.ns,
                lifetime="detached" if self.detach else None, max_restarts=pool.max_restarts, max_task_retries=0,
                max_concurrency=4, num_cpus=bundle.pop("CPU", 0), num_gpus=bundle.pop("GPU", 0), resources=bundle,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
            ).remote(spec, self._instance_env(plan.name, env))

    def _instance_env(self, name: str, env: dict[str, str]) -> dict[str, str]:
        """The environment of one worker actor: the shared secrets plus its own identities
        (CURVE pair, TLS certificate) and its torch thread count (--worker-threads)."""
        own = self._secrets.instance_env.get(name, {}) if self._secrets is not None else {}
        threads = {ENV_THREADS: str(self.threads[name])} if name in self.threads else {}
        return {**env, **own, **threads, **(self.tls.worker_env(name) if self.tls is not None else {})}

    def _wait_workers(self) -> None:
        import ray

        timeout = self.config.ready_timeout_s
        refs = {name: a.ready.remote(timeout) for name, a in self.workers.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout + 10)
        failed = []
        for name, ref in refs.items():
            try:
                self.ready[name] = ray.get(ref, timeout=0.1)
            except Exception as e:  # RuntimeError from ready(), RayActorError, GetTimeoutError
                failed.append(f"  {name}: {_why(e)}")
        if failed:
            raise LaunchError(f"{len(failed)} of {len(refs)} workers did not come up:\n" + "\n".join(failed))

    def _create_router(self, env: dict[str, str]) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from pdcluster.cluster.ray_actors import RouterActor

        spec = self.router_spec()
        # The router's ports are on this node: what `up` prints is reachable from here.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.router = ray.remote(RouterActor).options(
            name=actor_name(self.ns, ROUTER), namespace=self.ns, lifetime="detached" if self.detach else None,
            num_cpus=0, max_restarts=_router_restarts(self.config), max_task_retries=0,
            scheduling_strategy=here).remote(spec, env)

    def router_spec(self) -> dict[str, Any]:
        """The router actor's spec: RouterConfig fields (plus name/namespace, RouterActor's)."""
        return {**asdict(self.config.router), "model": self.config.model, "insecure": self.insecure,
                "disagg_mode": self.disagg_mode, "namespace": self.ns}

    def _start_router(self) -> None:
        import ray

        timeout = self.config.ready_timeout_s
        try:
            self.endpoints = ray.get(self.router.start.remote({n: w["address"] for n, w in self.ready.items()}),
                                     timeout=timeout)
            healthy = ray.get(self.router.wait_for_healthy.remote(len(self.ready), timeout), timeout=timeout + 10)
        except Exception as e:
            raise LaunchError(f"the router did not come up: {_why(e)}") from e
        if not healthy:
            sick = [w for w in ray.get(self.router.workers.remote(), timeout=30) if not w["healthy"]]
            lines = [f"  {w['name'] or w['address']}: not healthy at the router ({w['address']})" for w in sick]
            raise LaunchError(f"{len(sick)} worker(s) not healthy within {timeout:g}s:\n" + "\n".join(lines))
        self.endpoints = {**self.endpoints, "namespace": self.ns, "ray_address": self._reconnect_address(),
                          "instances": {n: _summary(w) for n, w in self.ready.items()}}

    def _reconnect_address(self) -> str:
        """The address `status`/`down` connect to later."""
        import ray

        if self.head is not None:
            return self.head.address
        if self.address == "auto" and ray.is_initialized():
            return ray.get_runtime_context().gcs_address
        return self.address

    def _state(self) -> dict[str, Any]:
        head = self.head
        return {"namespace": self.ns, "ray_address": self._reconnect_address(), "detached": self.detach,
                "head_pid": head.pid if head else None, "head_start": head.start_time if head else 0,
                "key_dir": self._key_tmp, "internal_tls": self.tls is not None,
                "tls_key_dir": self.tls.key_dir if self.tls is not None else None, "ray_auth_mode": (head.env if head else os.environ).get("RAY_AUTH_MODE"),
                "endpoints": self.endpoints}

    # -- TLS rotation (ray_tls_push.py) ---------------------------------------------------------
    def reload_tls(self) -> dict[str, Any]:
        """Re-read --key-dir's CA and send every actor its new identity, in three phases."""
        from pdcluster.cluster.ray_tls_push import cluster_actors, push_rotation, ray_send

        if self.tls is None:
            raise LaunchError("internal gRPC runs without TLS (--insecure-internal): nothing to rotate")
        changed = self.tls.reload()
        report = push_rotation(self.tls, cluster_actors(self.ns), ray_send(self.ns))
        self.tls_rotations += 1
        return {**report, "ca_changed": changed}

    def refresh_tls(self) -> dict[str, str]:
        """After a rotation: actors restarted with their start-up identity get a current one."""
        from pdcluster.cluster.ray_tls_push import cluster_actors, ray_send, refresh

        if self.tls is None or not self.tls_rotations:
            return {}
        return refresh(self.tls, cluster_actors(self.ns), ray_send(self.ns))

    # -- down -----------------------------------------------------------------------------------
    def down(self) -> dict[str, Any]:
        """Stop what this launcher started: the namespace's actors and groups (once it found the
        namespace empty), the local head, the generated keys."""
        from pdcluster.cluster.ray_teardown import teardown

        report = teardown(self.ns, head=self.head, shutdown=self._owns_ray,
                          namespace_too=self._claimed)
        if self._claimed or self.head is not None:  # else the state file is another cluster's
            ray_head.remove_state(self.ns)
        self._owns_ray = self._claimed = False
        if self._key_tmp is not None:
            shutil.rmtree(self._key_tmp, ignore_errors=True)
            self._key_tmp = None
        self.workers.clear()
        self.groups.clear()
        self.router = None
        return report


def _worker_argv(config: ClusterConfig, role: str) -> list[str]:
    actions = worker_flag_actions()
    pool = config.pools[role]
    argv = ["--role", role, *(["--model", config.model] if config.model else []), *engine_argv(pool.engine, actions)]
    if pool.tp > 1:
        argv += [str(worker_flag(actions, "tp")), str(pool.tp)]
    if config.connector is not None and role != "encode":  # its options (with secrets) go through the environment
        argv += [str(worker_flag(actions, "connector")), config.connector.name]
    if config.ec_connector is not None:  # likewise (ray_secrets: the instance's pair, the allow-list)
        argv += ["--ec-connector", config.ec_connector.name]
    return argv


def worker_threads(config: ClusterConfig, plans: list[InstancePlan], nodes: dict[str, NodeInfo],
                   flag: str, environ: Any = None) -> dict[str, int]:
    """Torch threads per TP rank of each instance for --worker-threads (serve's meaning, per node):
    auto = its node's CPUs split evenly between all the worker ranks placed on that node; N = N;
    0, or PDCLUSTER_NUM_THREADS / OMP_NUM_THREADS set for `up`: none given (that one wins)."""
    from pdcluster.cluster.serve_cmd import worker_thread_count

    ranks: dict[str, int] = {}
    for p in plans:
        ranks[p.node_id] = ranks.get(p.node_id, 0) + config.pools[p.pool].tp
    out: dict[str, int] = {}
    for p in plans:
        node = nodes.get(p.node_id)
        cpus = int(node.resources.get("CPU", 0)) if node is not None else 0
        n = worker_thread_count(flag, [ranks[p.node_id]], cpus or os.cpu_count() or 1, environ)
        if n is not None:
            out[p.name] = n
    return out


def _router_restarts(config: ClusterConfig) -> int:
    """The router is restarted as often as the most-restarted pool (-1: without limit); a restarted
    router resumes on its recorded ports with the workers' current addresses (RouterActor.resume)."""
    counts = [pool.max_restarts for pool in config.pools.values()] or [3]
    return -1 if -1 in counts else max(counts)


def _worker_reads_connector_env() -> bool:
    from pdcluster.cluster import worker_cmd

    return getattr(worker_cmd, "ENV_KV_OPTIONS", None) == ENV_CONNECTOR_OPTIONS


def _why(e: BaseException) -> str:
    text = str(e).strip()
    # Ray wraps the actor's exception; its own message is the useful part.
    return text.split("RuntimeError: ", 1)[-1] if "RuntimeError: " in text else f"{type(e).__name__}: {text}"


def _summary(w: dict[str, Any]) -> dict[str, Any]:
    return {k: w.get(k) for k in ("address", "role", "node_id", "node_ip", "actor_pid", "child_pid", "metrics")}
