"""Chaos test fixtures: the demo model, the cluster keys the workers load, a loop thread for the
in-process routers, the offline engine as the reference for tokens, and the table of results a
long run writes ($PDCLUSTER_CHAOS_TABLE: a markdown file, one row per fault x role)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from chaos.leaks import ResultRow, write_table
from real_router_cluster import WORKER_MAX_MODEL_LEN, WORKER_NUM_KV_BLOCKS, LoopThread


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
    loop = LoopThread()
    try:
        yield loop
    finally:
        loop.close()


class Reference:
    """The offline engine on the same checkpoint and cache size as the workers."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._llm: Any = None

    def tokens(self, prompt: list[int], max_tokens: int) -> list[int]:
        from pdcluster import LLM, SamplingParams

        if self._llm is None:
            self._llm = LLM(self.model, max_model_len=WORKER_MAX_MODEL_LEN, num_kv_blocks=WORKER_NUM_KV_BLOCKS)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return list(self._llm.generate([prompt], params)[0].outputs[0].token_ids)


@pytest.fixture(scope="session")
def reference(demo_model: str) -> Reference:
    return Reference(demo_model)


@pytest.fixture(scope="session")
def chaos_rows() -> Iterator[list[ResultRow]]:
    rows: list[ResultRow] = []
    yield rows
    path = os.environ.get("PDCLUSTER_CHAOS_TABLE")
    if path and rows:
        write_table(pathlib.Path(path), rows)
