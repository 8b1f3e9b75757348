"""One P2P prefill worker (p0) and one decode worker (d0), real `serve-worker` processes kept for a
test module, and routers in front of them: what the hand-off and concurrent-mode tests share."""

from __future__ import annotations

import contextlib
import json
import pathlib
import secrets
from collections.abc import Callable, Iterator
from typing import Any

from chaos.mark_hold_pool import MarkHoldPool
from real_router_cluster import Cluster, LoopThread, router_cluster

from pdcluster._proto import common_pb2, router_pb2


def p2p_pair_pool(model: str, key_dir: pathlib.Path, log_dir: pathlib.Path, marks: tuple[int, ...],
                  **options: Any) -> MarkHoldPool:
    """p0 (prefill) and d0 (decode, holding "mig-" requests at `marks`), sharing one P2P secret;
    `options` go to the P2P connector."""
    options = {"params_secret": secrets.token_hex(32), **options}
    return MarkHoldPool(model, str(key_dir), log_dir, [("p0", "prefill"), ("d0", "decode")], marks,
                        extra_args=["--kv-connector", "p2p"],
                        env={"PDCLUSTER_KV_CONNECTOR_OPTIONS": json.dumps(options)})


@contextlib.contextmanager
def pair_clusters(loop_thread: LoopThread, pool: MarkHoldPool, model: str, key_dir: pathlib.Path,
                  **defaults: Any) -> Iterator[Callable[..., Cluster]]:
    """make(**overrides) -> a healthy router over p0 and d0 (`defaults` under the overrides); on
    exit every router made is closed and the pool's workers revived."""
    made: list[Cluster] = []

    def make(**overrides: Any) -> Cluster:
        workers = pool.take_named(("p0", "d0"))
        c = router_cluster(loop_thread, workers, model, request_timeout_s=120.0, key_dir=str(key_dir),
                           **{**defaults, **overrides})
        made.append(c)
        assert c.wait_healthy(len(workers)), "the workers did not become healthy"
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
        pool.revive()


def request(ids: list[int], max_tokens: int, request_id: str = "") -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=router_pb2.TokenIds(ids=ids), stream=True,
        sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def tokens(out: list) -> list[int]:
    return [t for r in out for t in r.token_ids]
