"""The Ray actors of `pdcluster up`: one WorkerActor per worker instance, one RouterActor.

WorkerActor supervises `pdcluster serve-worker` as a child process on its own node:

    __init__ --supervisor thread--> spawn child (PDEATHSIG: a killed actor takes its child along)
                                    read stdout for PDCLUSTER_READY {json} -> ready()
                                    child exits unexpectedly after ready -> os._exit(1): Ray
                                    restarts the actor (max_restarts), which starts a new child
    restarted incarnation, once ready -> RouterActor.register(name, new address)

The actor stays thin (no torch): the engine lives in the child, which owns its TP ranks. CURVE
keys reach the child through its environment (owner-only /proc/PID/environ), never its command
line. Its TLS identity (ray_tls.py: PEM in the actor's env) is written to a private folder
(0700, key 0600) and the child gets the paths. Everything crossing Ray calls is plain data.

RouterActor runs the router in-process on the actor's event loop; the launcher and restarted
workers update its registry with register(name, address) (remove the old address, add the new).
It is restarted by Ray too (max_restarts); a restarted incarnation resumes by itself:

    start() (first incarnation) -> records its bound ports + key folder in Ray's internal KV
    restarted __init__          -> resume(): rebuild the registry from the worker actors'
                                   describe() (a restarted worker has a new port), bind the
                                   recorded ports (clients reconnect to the same address), or
                                   free ones if taken (endpoints(), hence `status`, show them)
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from typing import Any

from pdcluster.cluster.private_dirs import make_private_folder
from pdcluster.cluster.ray_head import with_pdeathsig
from pdcluster.cluster.ray_router_state import forget_ports, recall_ports, reconstructed, remember_ports
from pdcluster.cluster.ray_secrets import bind_host_into, write_router_keys
from pdcluster.cluster.ray_tls import router_worker_tls, split_env, write_identity
from pdcluster.cluster.ray_tls_update import apply_update

READY_PREFIX = "PDCLUSTER_READY "
SERVE_WORKER = (sys.executable, "-m", "pdcluster.cluster.cli", "serve-worker")


def _node() -> tuple[str, str]:
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


class WorkerActor:
    """spec: name, argv (serve-worker flags without host/port/worker-id), host ("node_ip" or an
    address), log_dir, ready_timeout_s, router_name, namespace. env: secrets for the child."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str]) -> None:
        import ray

        self.spec = spec
        self.node_id, self.node_ip = _node()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the property itself reads Ray's deprecated actor_id
            self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}
        self.error: str | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._ready = threading.Event()
        self._stopping = False
        self._timed_out = False
        self._tls: Any = None  # ray_tls.TLSPaths: this instance's certificate files on its node
        # The thread that forks must outlive the child: PDEATHSIG fires when the forking thread ends.
        threading.Thread(target=self._supervise, args=(env,), name="supervisor", daemon=True).start()

    # -- Ray methods ----------------------------------------------------------------------------
    def ready(self, timeout_s: float) -> dict[str, Any]:
        """The child's readiness payload plus where it runs; RuntimeError with its log tail if it failed."""
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"{self.spec['name']}: no PDCLUSTER_READY within {timeout_s:g}s "
                               f"(pid {self.proc.pid if self.proc else '?'}); last log lines:\n{self._tail()}")
        if self.error is not None:
            raise RuntimeError(self.error)
        return self.describe()

    def describe(self) -> dict[str, Any]:
        return {**self.info, "name": self.spec["name"], "node_id": self.node_id, "node_ip": self.node_ip,
                "actor_pid": os.getpid(), "child_pid": self.proc.pid if self.proc else None,
                "restarted": self.restarted, "ready": self._ready.is_set() and self.error is None}

    def stop(self, grace_s: float = 10.0) -> dict[str, Any]:
        """SIGTERM the child (it aborts in-flight requests cleanly), SIGKILL after grace_s."""
        self._stopping = True
        proc = self.proc
        if proc is None:
            return {"child_pid": None, "returncode": None}
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # by pid: the one process this actor started
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._remove_tls()
        return {"child_pid": proc.pid, "returncode": proc.returncode}

    def update_tls(self, update: dict[str, str]) -> dict[str, Any]:
        """A rotation from the launcher (ray_tls_push.py): rewrite this instance's TLS files,
        which serve-worker's server credentials re-read at the next handshake."""
        if self._tls is None:
            raise RuntimeError(f"{self.spec['name']} runs without TLS files")
        return apply_update(self._tls, update, "worker", self.spec["name"])

    # -- the child ------------------------------------------------------------------------------
    def _supervise(self, env: dict[str, str]) -> None:
        spec = self.spec
        host = self.node_ip if spec.get("host", "node_ip") == "node_ip" else spec["host"]
        argv = [*SERVE_WORKER, *spec["argv"], "--host", host, "--port", "0", "--worker-id", spec["name"]]
        sink = self._open_log()
        env, pems = split_env(env)  # the child gets the paths of its identity, never the PEMs
        try:
            if pems is not None:
                self._tls = write_identity(pems)
                argv += self._tls.server_argv()
            self.proc = subprocess.Popen(with_pdeathsig(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env={**os.environ, **bind_host_into(env, host)},
                                         start_new_session=True)
        except OSError as e:
            self._remove_tls()
            self._fail(f"{spec['name']}: cannot start serve-worker: {e}")
            return
        errs = threading.Thread(target=self._pump, args=(self.proc.stderr, sink), daemon=True)
        errs.start()
        # No instance may hang unready forever (a restarted one has nobody waiting on it).
        watchdog = threading.Timer(float(spec.get("ready_timeout_s", 300.0)), self._ready_deadline)
        watchdog.daemon = True
        watchdog.start()
        self._pump(self.proc.stdout, sink, watch_ready=True)
        code = self.proc.wait()
        watchdog.cancel()
        errs.join(2.0)
        if self._stopping:
            self._remove_tls()
            return
        what = f"exited with {code}" if code >= 0 else f"killed by signal {-code}"
        if self._timed_out:
            what = f"printed no PDCLUSTER_READY within {spec.get('ready_timeout_s', 300.0):g}s (killed)"
        if not self._ready.is_set() and not self.restarted:
            self._fail(f"{spec['name']} (pid {self.proc.pid}) {what} before it was ready; last log lines:\n{self._tail()}")
            return
        # A crash: exit the actor so Ray restarts it (up to max_restarts) with a fresh child.
        sys.stderr.write(f"[{spec['name']}] serve-worker (pid {self.proc.pid}) {what}; restarting the actor\n")
        sys.stderr.flush()
        self._remove_tls()  # the next incarnation writes its own copy
        os._exit(1)

    def _remove_tls(self) -> None:
        tls, self._tls = self._tls, None  # stop() and the supervisor thread may both get here
        if tls is not None:
            tls.remove()

    def _pump(self, stream: Any, sink: Any, watch_ready: bool = False) -> None:
        for raw in stream:
            line = raw.decode(errors="replace")
            if watch_ready and not self._ready.is_set() and line.startswith(READY_PREFIX):
                try:
                    self.info = json.loads(line[len(READY_PREFIX):])
                except ValueError:
                    pass
                else:
                    self._on_ready()
                    continue
            self.tail.append(line.rstrip("\n"))
            sink.write(f"[{self.spec['name']}] {line}" if sink is sys.stderr else line)
            sink.flush()

    def _ready_deadline(self) -> None:
        if not self._ready.is_set() and self.proc is not None and self.proc.poll() is None:
            self._timed_out = True
            self.proc.kill()

    def _on_ready(self) -> None:
        self._ready.set()
        if self.restarted:
            threading.Thread(target=self._register, name="register", daemon=True).start()

    def _register(self) -> None:
        """A restarted incarnation has a new port: tell the router (remove old, add new)."""
        import ray

        try:
            router = ray.get_actor(self.spec["router_name"], namespace=self.spec["namespace"])
            ray.get(router.register.remote(self.spec["name"], self.info["address"]), timeout=60)
        except Exception as e:  # the router gone is the launcher's to report, not a reason to die
            sys.stderr.write(f"[{self.spec['name']}] could not register with the router: {e}\n")

    def _fail(self, message: str) -> None:
        self.error = message
        self._ready.set()

    def _tail(self) -> str:
        return "\n".join(f"    {line}" for line in list(self.tail)[-20:])

    def _open_log(self) -> Any:
        log_dir = self.spec.get("log_dir")
        if not log_dir:
            return sys.stderr  # Ray's log folder (and the driver's terminal while it is attached)
        path = pathlib.Path(log_dir)
        path.mkdir(parents=True, exist_ok=True)
        return open(path / f"{self.spec['name']}.log", "a", encoding="utf-8")  # lives as long as the actor


class RouterActor:
    """spec: the router's config fields (RouterConfig names) plus name; env: the router's key pair
    ("PUBLIC,SECRET") and the workers' public key, for KV-event subscriptions, and (mutual TLS)
    the router certificate for its worker channels (ray_tls.py)."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str]) -> None:
        self.spec = dict(spec)
        self._env = env
        self.router: Any = None
        self.addresses: dict[str, str] = {}  # instance name -> worker address
        self._key_dir: str | None = None
        self._keys_folder: Any = None  # private_dirs.PrivateFolder of _key_dir: goes with this process
        self.node_id, self.node_ip = _node()
        self.resumed: dict[str, Any] | None = None  # what resume() did, for status and tests
        self._tls: Any = None  # ray_tls.TLSPaths of the router certificate (in _key_dir)
        if reconstructed():
            import ray

            # Queued behind __init__: runs as soon as this incarnation takes calls.
            ray.get_runtime_context().current_actor.resume.remote()

    async def start(self, workers: dict[str, str]) -> dict[str, Any]:
        from pdcluster.router.app import Router
        from pdcluster.router.config import RouterConfig

        # A worker that restarted before the router started has registered its new address already.
        self.addresses = {**workers, **self.addresses}
        fields = {k: v for k, v in self.spec.items() if k not in _NOT_CONFIG}
        curve, pems = split_env(self._env)
        if curve and self._key_dir is None:
            self._keys_folder = make_private_folder("pdcluster-router-keys-")
            self._key_dir = write_router_keys(curve, self._keys_folder.path)
        if pems is not None:  # mutual TLS to the workers: its files inside the private key folder
            if self._tls is None:
                self._tls = write_identity(pems, parent=self._key_dir)
            fields["worker_tls"] = router_worker_tls(self._tls)
        config = RouterConfig(workers=tuple(self.addresses.values()), key_dir=self._key_dir, **fields)
        router = Router(config)
        await router.start()
        self.router = router
        # Registrations that arrived while it was starting.
        current = set(self.addresses.values())
        for h in router.registry.handles:
            if h.address not in current:
                await router.registry.remove(h.address)
        for address in current:
            router.registry.add(address)  # idempotent
        remember_ports(self.spec, {"grpc_port": router.grpc_port, "http_port": router.http_port, "key_dir": self._key_dir})
        return await self.endpoints()

    async def resume(self) -> dict[str, Any]:
        """A restarted incarnation: the workers' current addresses, the previous ports if free."""
        if self.router is not None or self.resumed is not None:
            return self.resumed or {}
        self.resumed = {"resumed": False, "started": True}
        try:
            self.resumed = await self._resume()
        except Exception as e:  # kept for `status`: a restarted router that cannot serve says why
            self.resumed = {"resumed": False, "error": f"{type(e).__name__}: {e}"}
        return self.resumed

    async def _resume(self) -> dict[str, Any]:
        import ray

        prev = recall_ports(self.spec)
        if prev is None:  # the first incarnation never started: `up` reports that, nothing to resume
            return {"resumed": False, "error": "no recorded ports"}
        if prev.get("key_dir"):  # the killed process could not clean up its key folder (same node)
            shutil.rmtree(prev["key_dir"], ignore_errors=True)
        ns, me = self.spec["namespace"], self.spec.get("name", "router")
        workers: dict[str, str] = {}
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["namespace"] != ns or not a["name"].startswith(f"{ns}:") or a["name"] == f"{ns}:{me}":
                continue
            try:  # a worker restarting now is skipped: it registers itself once ready
                d = await asyncio.wait_for(ray.get_actor(a["name"], namespace=ns).describe.remote(), 10.0)
            except Exception:
                continue
            if d.get("ready") and d.get("address"):
                workers[a["name"].split(":", 1)[1]] = d["address"]
        wanted = {"grpc_port": prev.get("grpc_port") or 0, "http_port": prev.get("http_port")}
        self.spec.update(wanted)
        try:
            await self.start(workers)
            same, first_error = True, None
        except Exception as e:  # the port is taken by something else: free ones, published by endpoints()
            first_error = f"{type(e).__name__}: {e}"
            self.router = None
            self.spec.update(grpc_port=0, http_port=0 if wanted["http_port"] is not None else None)
            await self.start(workers)
            same = False
        return {"resumed": True, "same_ports": same, "workers": sorted(workers), "port_error": first_error}

    async def endpoints(self) -> dict[str, Any]:
        if self.router is None and self.resumed is None and reconstructed():
            await self.resume()  # in case the call queued by __init__ has not run yet
        ep = self.router.endpoints() if self.router is not None else {}
        if self.router is not None and self.spec.get("host") in ("0.0.0.0", "::"):  # a wildcard is not an address to dial
            ep["grpc"] = f"{self.node_ip}:{self.router.grpc_port}"
            ep["http"] = f"http://{self.node_ip}:{self.router.http_port}" if self.router.http_port else None
        return {**ep, "node_id": self.node_id, "actor_pid": os.getpid(), "instances": dict(self.addresses),
                "restarted": self.resumed is not None, "resume": self.resumed, "serving": self.router is not None}

    async def update_tls(self, update: dict[str, str]) -> dict[str, Any]:
        """A rotation from the launcher: rewrite the router certificate's files; its worker
        channels are rebuilt from them at the next health probe (router/tls_reload.py)."""
        if self._tls is None:
            raise RuntimeError("the router runs without TLS files")
        return apply_update(self._tls, update, "router", "router")

    async def wait_for_healthy(self, count: int, timeout_s: float) -> bool:
        return await self.router.registry.wait_for_healthy(count, timeout_s)

    async def register(self, name: str, address: str) -> None:
        old = self.addresses.get(name)
        self.addresses[name] = address
        if old == address or self.router is None:  # not started: start() takes the new address
            return
        if old is not None:
            await self.router.registry.remove(old)  # the dead incarnation: out of the policies now
        self.router.registry.add(address)  # takes traffic after its first SERVING check (+ GetInfo)

    async def workers(self) -> list[dict[str, Any]]:
        names = {a: n for n, a in self.addresses.items()}
        out: list[dict[str, Any]] = []
        if self.router is None:  # restarting: not serving yet
            return out
        for h in self.router.registry.handles:
            s = h.stats
            out.append({"name": names.get(h.address, ""), "worker_id": h.worker_id, "address": h.address,
                        "role": h.role, "healthy": h.healthy, "num_inflight": h.num_inflight,
                        "num_running": s.num_running if s else None, "num_waiting": s.num_waiting if s else None,
                        "kv_usage": s.kv_usage if s else None})
        return out

    async def drain_workers(self, timeout_s: float) -> dict[str, Any]:
        """Worker.Drain on every worker at once (`pdcluster down`, before stop): router/drain_workers.py."""
        from pdcluster.router.drain_workers import drain_workers

        return await drain_workers(self.router.registry, timeout_s) if self.router and self.router.registry else {}

    async def stop(self) -> None:
        forget_ports(self.spec)  # a stopped router is not to be resumed
        if self.router is not None:
            await self.router.stop()
            self.router = None
        if self._tls is not None:
            self._tls.remove()
            self._tls = None
        if self._keys_folder is not None:
            self._keys_folder.close()
            self._keys_folder = None
        if self._key_dir is not None:
            shutil.rmtree(self._key_dir, ignore_errors=True)
            self._key_dir = None


# Spec keys for the actor, not RouterConfig fields.
_NOT_CONFIG = frozenset({"name", "namespace"})
