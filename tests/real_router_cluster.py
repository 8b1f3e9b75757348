"""Router test harness over real workers: `pdcluster serve-worker` subprocesses (demo model, CPU)
and in-process routers on an event loop in a background thread, so tests drive them with
ordinary blocking clients (grpc sync stubs, the openai package, raw sockets).

    WorkerProc   one serve-worker process: spawn (non-blocking), wait for PDCLUSTER_READY,
                 kill / pause (SIGSTOP) / resume (SIGCONT) / restart on the same port, stop
    WorkerPool   the session's workers; after a test killed or paused some, revive() restarts
                 them in the background so the next test rarely waits
    Cluster      one router (any RouterConfig) in front of some of the pool's workers

Every process is started here and stopped here, by its own pid (SIGTERM, SIGKILL if it does
not exit in time), in the fixtures' finalizers whether the tests pass or fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import grpc

from pdcluster._proto import common_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

READY_PREFIX = "PDCLUSTER_READY "
WORKER_MAX_MODEL_LEN = 256
# 128 blocks of 16 tokens: eight full-length sequences per worker, and a small, fast-starting
# process (the default sizes the cache from memory: ~1 GB and seconds more per start).
WORKER_NUM_KV_BLOCKS = 128
# Workers run through held_cli: a request whose id starts with "held-" stops after its first few
# outputs until it is ended from outside (engine_hold.py), however fast the machine.
HELD_CLI = pathlib.Path(__file__).resolve().parent / "held_cli.py"


def wait_until(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run a plain function on the loop thread (router state is loop-owned)."""
        async def wrap() -> Any:
            return fn()

        return self.run(wrap())

    def close(self) -> None:
        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


# -- worker processes -----------------------------------------------------------------------------
class WorkerProc:
    """One `pdcluster serve-worker` process. The Popen happens on the caller's (main) thread."""

    cli = HELD_CLI  # the script run as `pdcluster`; a subclass may install another test hook

    def __init__(self, name: str, args: Sequence[str], log_dir: pathlib.Path, *, port: int = 0,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.args = list(args)
        self.log_dir = log_dir
        self.port = port  # the port it serves on once ready (0 until then on a first start)
        self.env = {**os.environ, "PDCLUSTER_DEVICE": "cpu", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.ready: dict = {}
        self.paused = False
        self._ready_event = threading.Event()
        self._stderr_path: pathlib.Path | None = None
        self._reader: threading.Thread | None = None
        self._terminated = False
        self.spawn()

    # -- start ----------------------------------------------------------------------------------
    def spawn(self, port: int | None = None) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is still running"
        if port is not None:
            self.port = port
        self.ready, self.paused, self._terminated = {}, False, False
        self._ready_event = threading.Event()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._stderr_path = self.log_dir / f"{self.name}-{time.monotonic_ns()}.stderr"
        argv = [sys.executable, str(self.cli), "serve-worker", *self.args, "--worker-id", self.name,
                "--port", str(self.port)]
        with open(self._stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                         env=self.env, text=True)
        proc, event = self.proc, self._ready_event

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(READY_PREFIX) and not event.is_set():
                    self.ready = json.loads(line[len(READY_PREFIX):])
                    event.set()
            event.set()  # exited: wait_ready() reports it

        self._reader = threading.Thread(target=read, name=f"{self.name}-stdout", daemon=True)
        self._reader.start()

    def wait_ready(self, timeout: float = 120.0) -> WorkerProc:
        if not self._ready_event.wait(timeout):
            raise TimeoutError(f"{self.name} not ready in {timeout}s:\n{self.stderr_tail()}")
        if not self.ready:
            assert self.proc is not None
            raise RuntimeError(f"{self.name} exited with {self.proc.wait(10)} before ready:\n{self.stderr_tail()}")
        self.port = int(self.ready["port"])
        return self

    def restart(self, timeout: float = 120.0) -> WorkerProc:
        """A new process on the same port (the routers know the worker by its address)."""
        self.stop()
        self.spawn(self.port)
        return self.wait_ready(timeout)

    # -- state ----------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def is_ready(self) -> bool:
        return self.alive and bool(self.ready)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def worker_id(self) -> str:
        return self.name

    def stderr_tail(self, n: int = 30) -> str:
        try:
            assert self._stderr_path is not None
            return "\n".join(self._stderr_path.read_text(errors="replace").splitlines()[-n:])
        except (OSError, AssertionError):
            return ""

    # -- faults and stopping (always by pid) ------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL: the worker dies at once, mid-request, as in a crash."""
        if self.alive:
            os.kill(self.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the process hangs (its sockets stay open but nothing answers)."""
        os.kill(self.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused and self.alive:
            os.kill(self.pid, signal.SIGCONT)
        self.paused = False

    def terminate(self) -> None:
        """SIGTERM (a clean shutdown) without waiting; stop() waits."""
        if self.alive and not self._terminated:
            self.resume()
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.alive:
            self.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        else:
            self.proc.wait(10)
        if self._reader is not None:
            self._reader.join(5)  # EOF follows the exit
        if self.proc.stdout is not None and not (self._reader and self._reader.is_alive()):
            self.proc.stdout.close()


def worker_stats(address: str, timeout: float = 5.0) -> common_pb2.WorkerStats:
    """The worker's own Stats, asked directly (not through a router)."""
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=timeout)


def is_idle(address: str) -> bool:
    """Nothing running or waiting, and every KV block free (blocks may stay prefix-cached)."""
    try:
        s = worker_stats(address)
    except grpc.RpcError:
        return False
    return s.num_running == 0 and s.num_waiting == 0 and s.num_kv_blocks_used == 0


class WorkerPool:
    """The session's `serve-worker --role both` processes (demo model), shared by the router tests."""

    def __init__(self, model: str, key_dir: str, log_dir: pathlib.Path, size: int = 3) -> None:
        self.args = ["--role", "both", "--model", model, "--max-model-len", str(WORKER_MAX_MODEL_LEN),
                     "--num-kv-blocks", str(WORKER_NUM_KV_BLOCKS), "--key-dir", key_dir, "--log-level", "WARNING"]
        self.log_dir = log_dir
        self.workers: list[WorkerProc] = []
        try:
            for i in range(size):  # all load in parallel
                self.workers.append(WorkerProc(f"w{i}", self.args, log_dir))
            for w in self.workers:
                w.wait_ready()
        except BaseException:
            self.close()
            raise

    def revive(self) -> None:
        """Resume paused workers and restart dead ones on their port, without waiting."""
        for w in self.workers:
            if w.paused:
                w.resume()
            if not w.alive:
                w.stop()  # reap it
                w.spawn()

    def take(self, n: int, timeout: float = 120.0) -> list[WorkerProc]:
        """n ready, idle workers: the ones already up first (restarts overlap with tests)."""
        assert n <= len(self.workers)
        self.revive()
        chosen = sorted(self.workers, key=lambda w: not w.is_ready)[:n]
        for w in chosen:
            try:
                w.wait_ready(timeout)
            except RuntimeError:  # its port was taken meanwhile: any free one will do
                w.stop()
                w.spawn(0)
                w.wait_ready(timeout)
        for w in chosen:
            assert wait_until(lambda w=w: is_idle(w.address), 30), f"{w.name} is not idle: {worker_stats(w.address)}"
        return chosen

    def close(self) -> None:
        for w in self.workers:  # all shut down in parallel
            w.terminate()
        for w in self.workers:
            w.stop()


# -- a router in front of pool workers ------------------------------------------------------------
class Cluster:
    def __init__(self, lt: LoopThread, router: Any, workers: list[WorkerProc]) -> None:
        self.lt = lt
        self.router = router
        self.workers = workers
        self.channel = grpc.insecure_channel(router.grpc_address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    @property
    def http_url(self) -> str:
        assert self.router.http_url is not None
        return self.router.http_url

    def wait_healthy(self, n: int, timeout: float = 20.0) -> bool:
        return self.lt.run(self.router.registry.wait_for_healthy(n, timeout), timeout + 5)

    def wait_settled(self, timeout: float = 20.0) -> bool:
        """Every worker's circuit breaker CLOSED. A newly admitted worker is HALF_OPEN until its
        next good check, and there the first failed check ejects it: tests that want the *request*
        to find a dead worker wait for this before killing one."""
        return wait_until(lambda: self.lt.call(
            lambda: all(h.healthy and h.breaker.state == "closed" for h in self.router.registry.handles)), timeout)

    def healthy_ids(self) -> set[str]:
        return self.lt.call(lambda: {h.worker_id for h in self.router.registry.handles if h.healthy})

    def stats(self, i: int) -> common_pb2.WorkerStats:
        return worker_stats(self.workers[i].address)

    def wait_idle(self, i: int, timeout: float = 10.0) -> bool:
        return wait_until(lambda: is_idle(self.workers[i].address), timeout)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.lt.call(lambda: self.router.metrics.registry.get_sample_value(name, labels or {}))
        return 0.0 if value is None else value

    def metrics_text(self) -> str:
        return self.lt.call(lambda: self.router.metrics.render().decode())

    def close(self) -> None:
        self.channel.close()
        self.lt.run(self.router.stop(0.5))


def router_cluster(loop_thread: LoopThread, workers: list[WorkerProc], model: str, **overrides: Any) -> Cluster:
    """An in-process Router (free ports, round robin, quick health checks) in front of `workers`,
    started on `loop_thread`; `overrides` are RouterConfig fields. Not yet waited healthy."""
    from pdcluster.router.app import Router
    from pdcluster.router.config import RouterConfig

    config = RouterConfig(**{
        "workers": tuple(w.address for w in workers), "model": model, "grpc_port": 0, "http_port": 0,
        "health_interval_s": 0.1, "health_timeout_s": 1.0, "request_timeout_s": 60.0, "policy": "round_robin",
        **overrides})
    router = Router(config)
    loop_thread.run(router.start())
    return Cluster(loop_thread, router, workers)
