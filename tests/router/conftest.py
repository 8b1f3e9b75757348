"""Router test harness: routers and fake workers on an event loop in a background thread, so
tests drive them with ordinary blocking clients (grpc sync stubs, the openai package, sockets)."""

from __future__ import annotations

import asyncio
import pathlib
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import grpc
import pytest

from pdcluster._proto import router_pb2_grpc
from pdcluster.router.app import Router
from pdcluster.router.config import RouterConfig
from pdcluster.router.testing import FakeWorker, FakeWorkerOptions


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


class FakeCluster:
    def __init__(self, lt: LoopThread, router: Router, workers: list[FakeWorker]) -> None:
        self.lt = lt
        self.router = router
        self.workers = workers
        self.channel = grpc.insecure_channel(router.grpc_address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    @property
    def http_url(self) -> str:
        assert self.router.http_url is not None
        return self.router.http_url

    def stop_worker(self, i: int) -> int:
        port = self.workers[i].port
        self.lt.run(self.workers[i].stop())
        return port

    def restart_worker(self, i: int, port: int) -> None:
        worker = FakeWorker(self.workers[i].opts)
        self.lt.run(worker.start(port=port))
        self.workers[i] = worker

    def wait_healthy(self, n: int, timeout: float = 10.0) -> bool:
        return self.lt.run(self.router.registry.wait_for_healthy(n, timeout), timeout + 5)

    def healthy_ids(self) -> set[str]:
        return self.lt.call(lambda: {h.worker_id for h in self.router.registry.handles if h.healthy})

    def close(self) -> None:
        self.channel.close()
        self.lt.run(self.router.stop(0.5))
        for w in self.workers:
            self.lt.run(w.stop())


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdcluster.models.demo import ensure_demo_model

    return str(ensure_demo_model(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(scope="session")
def key_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from pdcluster.security.keys import init_keys

    root = tmp_path_factory.mktemp("keys") / "cluster"
    init_keys(root, ("router", "worker", "client"))
    return root


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    try:
        yield lt
    finally:
        lt.close()


@pytest.fixture
def fake_cluster(loop_thread: LoopThread, demo_model: str) -> Iterator[Callable[..., FakeCluster]]:
    """make(num_workers, worker options..., router config overrides...) -> a running FakeCluster."""
    made: list[FakeCluster] = []

    def make(num_workers: int = 2, *, worker_opts: list[dict] | None = None, wait: bool = True,
             **router_overrides: Any) -> FakeCluster:
        workers = []
        for i in range(num_workers):
            opts = {"worker_id": f"w{i}", **((worker_opts or [{}] * num_workers)[i])}
            w = FakeWorker(FakeWorkerOptions(**opts))
            loop_thread.run(w.start())
            workers.append(w)
        config = RouterConfig(**{
            "workers": tuple(f"127.0.0.1:{w.port}" for w in workers), "model": demo_model, "grpc_port": 0,
            "http_port": 0, "health_interval_s": 0.1, "health_timeout_s": 1.0, "request_timeout_s": 30.0,
            "policy": "round_robin", **router_overrides})
        router = Router(config)
        loop_thread.run(router.start())
        cluster = FakeCluster(loop_thread, router, workers)
        made.append(cluster)
        if wait:
            assert cluster.wait_healthy(num_workers), "fake workers did not become healthy"
        return cluster

    try:
        yield make
    finally:
        for c in made:
            c.close()
