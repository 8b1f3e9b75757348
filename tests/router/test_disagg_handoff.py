"""The hand-off between the legs of a disaggregated request, in front of real prefill and decode
`serve-worker` processes (P2P connector, demo model, CPU). The router starts the decode leg before
it writes t0 to the client (orchestrator._disaggregated), so a client that goes away or an Abort
right after t0 lands while the decode leg is starting, admitting or pulling: both workers must
end with every KV block free (the producer's lease dropped, the consumer's blocks freed), and the
output must still equal an aggregated run token for token.

The decode worker holds "mig-" requests at output length MARK (tests/chaos/mark_hold.py), so an
abort of such a request lands while its decode leg is certainly running, on any machine.
"""

from __future__ import annotations

import pathlib
import random
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from chaos.mark_hold_pool import MarkHoldPool
from pd_pair import p2p_pair_pool, pair_clusters, request, tokens
from real_router_cluster import (
    Cluster,
    LoopThread,
    WorkerProc,
    is_idle,
    wait_until,
    worker_stats,
)

from pdcluster._proto import common_pb2

MARK = 4
ABORT = common_pb2.FINISH_REASON_ABORT
LENGTH = common_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def pool(demo_model: str, key_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarkHoldPool]:
    p = p2p_pair_pool(demo_model, key_dir, tmp_path_factory.mktemp("handoff-logs"), (MARK,))
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def cluster(loop_thread: LoopThread, pool: MarkHoldPool, demo_model: str,
            key_dir: pathlib.Path) -> Iterator[Callable[..., Cluster]]:
    with pair_clusters(loop_thread, pool, demo_model, key_dir) as make:
        yield make


def both_idle(c: Cluster) -> bool:
    return all(wait_until(lambda w=w: is_idle(w.address), 30) for w in c.workers)


def stats(c: Cluster) -> dict[str, Any]:
    return {w.name: worker_stats(w.address) for w in c.workers}


def test_disaggregated_equals_aggregated(cluster, reference):
    c = cluster()
    rng = random.Random(20261202)  # prompts no other test sends
    for n in (5, 40, 100):
        prompt = [rng.randrange(10, 600) for _ in range(n)]
        out = list(c.stub.Generate(request(prompt, 12), timeout=120))
        want = reference.generate(prompt, max_tokens=12)
        assert out[-1].route.disaggregated and out[-1].finish_reason == LENGTH
        assert tokens(out) == list(want.token_ids)
        assert "".join(r.text for r in out) == want.text
        assert out[-1].usage.completion_tokens == 12
    assert both_idle(c), stats(c)


def test_client_gone_right_after_the_first_token_frees_both_sides(cluster, reference):
    c = cluster()
    rng = random.Random(20261203)
    for n in (8, 64):
        stream = c.stub.Generate(request([rng.randrange(10, 600) for _ in range(n)], 30), timeout=120)
        first = next(stream)  # t0, from the prefill leg; the decode leg is starting meanwhile
        assert first.token_ids
        stream.cancel()
        assert both_idle(c), stats(c)
    # The pair still serves, token-exact.
    prompt = [rng.randrange(10, 600) for _ in range(20)]
    assert tokens(list(c.stub.Generate(request(prompt, 6), timeout=120))) == reference.tokens(prompt, 6)


def test_abort_after_the_first_token_frees_both_sides(cluster):
    c = cluster()
    request_id = f"mig-{uuid.uuid4().hex[:12]}"  # the decode worker holds it at MARK tokens
    stream = c.stub.Generate(request([31, 32, 33, 34, 35, 36], 30, request_id), timeout=120)
    got = [next(stream)]
    assert got[0].token_ids
    resp = c.stub.Abort(common_pb2.AbortRequest(request_ids=[request_id]), timeout=10)
    assert list(resp.aborted_request_ids) == [request_id]
    got += list(stream)
    assert got[-1].finished and got[-1].finish_reason == ABORT, got[-1]
    assert len(tokens(got)) < 30
    assert both_idle(c), stats(c)


def test_decode_worker_gone_before_the_first_decode_token_ends_cleanly(cluster, pool):
    """The decode leg (started before t0 was written) fails: the request migrates or ends with a
    clear error after t0, never hangs; the prefill worker's lease is freed either way."""
    c = cluster(max_migrations=0)
    request_id = f"mig-{uuid.uuid4().hex[:12]}"
    stream = c.stub.Generate(request([41, 42, 43, 44, 45], 30, request_id), timeout=120)
    got = [next(stream)]
    decode: WorkerProc = next(w for w in c.workers if w.name == "d0")
    decode.kill()
    got += list(stream)
    last = got[-1]
    assert last.finished and last.finish_reason == common_pb2.FINISH_REASON_ERROR, last
    assert last.error_message
    prefill = next(w for w in c.workers if w.name == "p0")
    assert wait_until(lambda: is_idle(prefill.address), 60), worker_stats(prefill.address)


def test_handoff_trace_is_opt_in(tmp_path, monkeypatch):
    from pdcluster.handoff_trace import trace

    monkeypatch.delenv("PDCLUSTER_HANDOFF_TRACE", raising=False)
    trace("r.prefill_sent", "req-1")  # unset: nothing written anywhere
    path = tmp_path / "trace.txt"
    monkeypatch.setenv("PDCLUSTER_HANDOFF_TRACE", str(path))
    trace("r.prefill_sent", "req-1")
    trace("d.ready", "req-1")
    lines = [line.split(" ") for line in path.read_text().splitlines()]
    assert [(e, r) for _, e, r in lines] == [("r.prefill_sent", "req-1"), ("d.ready", "req-1")]
    assert float(lines[0][0]) <= float(lines[1][0])
