"""Router test fixtures: real `pdcluster serve-worker` processes (demo model, CPU) started once per
session, routers started per test in front of them, and the offline `pdcluster.LLM` as the
reference for tokens. The harness itself is in tests/real_router_cluster.py."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # test_openai_features' helpers
from real_router_cluster import (
    WORKER_MAX_MODEL_LEN,
    WORKER_NUM_KV_BLOCKS,
    Cluster,
    LoopThread,
    WorkerPool,
    router_cluster,
)


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


@pytest.fixture(scope="session")
def worker_pool(demo_model: str, key_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    """Three `serve-worker --role both` processes (w0, w1, w2) for the whole session. Tests that
    kill or pause one leave it to the pool, which restarts or resumes it before the next test."""
    pool = WorkerPool(demo_model, str(key_dir), tmp_path_factory.mktemp("worker-logs"), size=3)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    loop = LoopThread()
    try:
        yield loop
    finally:
        loop.close()


@pytest.fixture
def cluster(loop_thread: LoopThread, worker_pool: WorkerPool, demo_model: str) -> Iterator[Callable[..., Cluster]]:
    """make(num_workers, router config overrides...) -> a Router (in-process) in front of that many
    idle pool workers, healthy and ready."""
    made: list[Cluster] = []

    def make(num_workers: int = 2, *, wait: bool = True, **router_overrides: Any) -> Cluster:
        workers = worker_pool.take(num_workers)
        model = router_overrides.pop("model", demo_model)  # None: the router asks a worker, as under `up`
        c = router_cluster(loop_thread, workers, model, request_timeout_s=60.0, **router_overrides)
        made.append(c)
        if wait:
            assert c.wait_healthy(num_workers), "the workers did not become healthy"
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
        worker_pool.revive()  # restarts what the test killed while the next one sets up


class Reference:
    """The offline engine on the same checkpoint: what the workers must produce."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._llm = None

    @property
    def llm(self) -> Any:
        if self._llm is None:
            from pdcluster import LLM

            self._llm = LLM(self.model, max_model_len=WORKER_MAX_MODEL_LEN, num_kv_blocks=WORKER_NUM_KV_BLOCKS)
        return self._llm

    def generate(self, prompt: str | list[int], **params: Any) -> Any:
        """One CompletionOutput (token_ids, text, finish_reason); greedy unless told otherwise."""
        from pdcluster import SamplingParams

        params.setdefault("temperature", 0.0)
        params.setdefault("ignore_eos", True)
        return self.llm.generate([prompt], SamplingParams(**params))[0].outputs[0]

    def tokens(self, prompt: str | list[int], max_tokens: int, **params: Any) -> list[int]:
        return list(self.generate(prompt, max_tokens=max_tokens, **params).token_ids)

    def batch_tokens(self, prompts: list, max_tokens: int) -> list[list[int]]:
        """Greedy tokens of several prompts, run as one batch."""
        from pdcluster import SamplingParams

        sampling_params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in self.llm.generate(prompts, sampling_params)]

    def chat(self, messages: list[dict[str, str]], **params: Any) -> Any:
        from pdcluster import SamplingParams

        params.setdefault("temperature", 0.0)
        params.setdefault("ignore_eos", True)
        return self.llm.chat(messages, SamplingParams(**params))[0].outputs[0]


@pytest.fixture(scope="session")
def reference(demo_model: str) -> Reference:
    return Reference(demo_model)
