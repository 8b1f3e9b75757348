"""Disaggregated serving in front of real prefill and decode `serve-worker` processes (P2P
connector, demo model, CPU): a decode worker SIGKILLed mid-stream (the request migrates to the
other decode worker, which computes the prompt itself and continues after the tokens sent), a
prefill worker dead before the first token (retried on the other), and conditional
disaggregation (`prefix_aware` + disagg_min_uncached_tokens: a prompt whose uncached part is short
is served by a decode worker alone, a longer one is disaggregated; the threshold both ways), and
load-aware disaggregation (a prefill worker stopped with a backlog over the limit: the decode
worker prefills the next request).

Decode workers run through tests/chaos/mark_hold_cli.py: a "mig-" request stops at output length
4 until its worker is killed (mark_hold.py), so the kill lands mid-request on any machine.
"""

from __future__ import annotations

import json
import pathlib
import random
import secrets
import types
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from chaos.mark_hold_pool import MarkHoldPool
from real_router_cluster import (
    Cluster,
    LoopThread,
    WorkerProc,
    is_idle,
    router_cluster,
    wait_until,
    worker_stats,
)

from pdcluster._proto import common_pb2, router_pb2

MARK = 4
LENGTH = common_pb2.FINISH_REASON_LENGTH
PROMPT = [21, 22, 23, 24, 25]
MODES = "pdcluster_router_disaggregated_requests_total"


@pytest.fixture(scope="module")
def disagg_pool(demo_model: str, key_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarkHoldPool]:
    """p0, p1 (prefill) and d0, d1 (decode, holding "mig-" requests at MARK), one P2P secret."""
    pool = MarkHoldPool(demo_model, str(key_dir), tmp_path_factory.mktemp("disagg-logs"),
                        [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")], (MARK,),
                        extra_args=["--kv-connector", "p2p"],
                        env={"PDCLUSTER_KV_CONNECTOR_OPTIONS": json.dumps({"params_secret": secrets.token_hex(32)})})
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def make(loop_thread: LoopThread, disagg_pool: MarkHoldPool, demo_model: str,
         key_dir: pathlib.Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(names: tuple[str, ...] = ("p0", "d0", "d1"), **overrides: Any) -> Cluster:
        workers = disagg_pool.take_named(names)
        c = router_cluster(loop_thread, workers, demo_model, request_timeout_s=120.0, key_dir=str(key_dir), **overrides)
        made.append(c)
        assert c.wait_healthy(len(workers)), "the workers did not become healthy"
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
        disagg_pool.revive()


def sampling(max_tokens: int, **kwargs: Any) -> common_pb2.SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


def tokens(out: list) -> list[int]:
    return [t for r in out for t in r.token_ids]


def final(c: Cluster, ids: list[int], max_tokens: int = 4) -> list:
    return list(c.stub.Generate(router_pb2.GenerateRequest(
        prompt_token_ids=router_pb2.TokenIds(ids=ids), sampling_params=sampling(max_tokens), stream=True), timeout=120))


def by_name(c: Cluster, name: str) -> WorkerProc:
    return next(w for w in c.workers if w.name == name)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_decode_worker_killed_mid_stream(make, reference, seeded):
    params = dict(temperature=0.8, top_p=0.9, seed=99, presence_penalty=0.3) if seeded else {}
    want = reference.generate(PROMPT, max_tokens=30, **params)
    c = make()
    stream = c.stub.Generate(router_pb2.GenerateRequest(
        request_id=f"mig-{uuid.uuid4().hex[:12]}", prompt_token_ids=router_pb2.TokenIds(ids=PROMPT),
        sampling_params=sampling(30, **params), stream=True), timeout=120)
    got: list = []
    while sum(len(r.token_ids) for r in got) < MARK:
        got.append(next(stream))
    decoders = [by_name(c, "d0"), by_name(c, "d1")]
    assert wait_until(lambda: any(worker_stats(w.address).num_running == 1 for w in decoders), 30)
    serving = next(w for w in decoders if worker_stats(w.address).num_running == 1)
    serving.kill()
    got += list(stream)
    last = got[-1]
    assert last.finish_reason == LENGTH, last
    assert tokens(got) == list(want.token_ids)
    assert "".join(r.text for r in got) == want.text
    assert last.usage.completion_tokens == 30
    other = next(w for w in decoders if w is not serving)
    assert last.route.disaggregated and last.route.num_migrations == 1
    assert last.route.decode_worker_id == other.worker_id
    assert c.metric("pdcluster_router_migrations_total", {"reason": "worker_lost"}) == 1
    for w in (by_name(c, "p0"), other):
        assert wait_until(lambda w=w: is_idle(w.address), 30), worker_stats(w.address)


def test_prefill_worker_dead_before_the_first_token_is_retried(make, reference):
    c = make(("p0", "p1", "d0"), eject_after_failures=50)
    assert c.wait_settled()
    first = by_name(c, "p0")  # round robin: a fresh router picks the first prefill worker first
    first.kill()
    out = final(c, PROMPT, 12)
    assert tokens(out) == reference.tokens(PROMPT, 12)
    last = out[-1]
    assert last.route.disaggregated and last.route.num_retries == 1 and last.route.prefill_worker_id == "p1"
    assert c.metric("pdcluster_router_retries_total", {"role": "prefill"}) == 1
    assert c.metric("pdcluster_router_migrations_total", {"reason": "worker_lost"}) == 0


THRESHOLD = 32


def cached_tokens(c: Cluster, ids: list[int]) -> int:
    """What the router's conditional disaggregation sees as cached on the decode workers."""
    prep = types.SimpleNamespace(prompt_token_ids=ids, mm_offset=None, sampling_params=common_pb2.SamplingParams())
    probe = types.SimpleNamespace(request_id="probe", prep=prep, block_hashes=None)
    return c.lt.call(lambda: c.router.orchestrator._best_cached_tokens(probe))


def test_conditional_disaggregation_follows_the_uncached_part(make, reference):
    c = make(("p0", "d0"), policy="prefix_aware", disagg_min_uncached_tokens=THRESHOLD)
    rng = random.Random(20261201)  # prompts no other test sends: the workers' caches outlive tests
    base = [rng.randrange(10, 600) for _ in range(96)]  # 6 blocks of 16
    modes = lambda: (c.metric(MODES, {"mode": "aggregated"}), c.metric(MODES, {"mode": "disaggregated"}))  # noqa: E731

    # A long fresh prompt: disaggregated; the decode worker then holds its KV (loaded, published).
    out = final(c, base + [7])
    assert out[-1].route.disaggregated and out[-1].route.prefill_worker_id == "p0"
    assert tokens(out) == reference.tokens(base + [7], 4)
    assert modes() == (0, 1)
    assert wait_until(lambda: cached_tokens(c, base + [8]) >= 96, 30)

    # Its prefix plus a short tail (uncached 96+THRESHOLD-96 = THRESHOLD tokens, at most the
    # threshold): the decode worker serves it alone, prefilling the tail itself.
    short = base + [rng.randrange(10, 600) for _ in range(THRESHOLD)]
    out = final(c, short)
    assert not out[-1].route.disaggregated and out[-1].route.decode_worker_id == "d0"
    assert out[-1].route.prefill_worker_id == ""
    assert out[-1].usage.cached_tokens >= 96  # it really reused the blocks
    assert tokens(out) == reference.tokens(short, 4)
    assert modes() == (1, 1)

    # One token more than the threshold uncached: disaggregated again.
    long = base + [rng.randrange(10, 600) for _ in range(THRESHOLD + 1)]
    out = final(c, long)
    assert out[-1].route.disaggregated
    assert tokens(out) == reference.tokens(long, 4)
    assert modes() == (1, 2)

    # Short prompts nobody cached: at most the threshold -> the decode worker; above it -> split.
    fresh = [rng.randrange(10, 600) for _ in range(THRESHOLD)]
    assert not final(c, fresh)[-1].route.disaggregated
    fresh = [rng.randrange(10, 600) for _ in range(THRESHOLD + 1)]
    assert final(c, fresh)[-1].route.disaggregated
    assert modes() == (2, 3)


def test_threshold_zero_always_disaggregates(make):
    c = make(("p0", "d0"), policy="prefix_aware", disagg_min_uncached_tokens=0)
    assert final(c, [5, 6])[-1].route.disaggregated
    assert c.metric(MODES, {"mode": "aggregated"}) == 0


def test_decode_worker_prefills_while_the_prefill_worker_is_behind(make, reference):
    """Load-aware disaggregation (disagg_max_prefill_backlog_tokens): the prefill worker is stopped
    (SIGSTOP) holding a prompt longer than the limit, so the next request is prefilled by the decode
    worker instead of queueing behind it. Resumed, the prefill worker finishes the held request
    disaggregated, the router's backlog counts return to zero, and with the prefill worker keeping
    up requests are disaggregated again. No health checks meanwhile: a stopped worker would be
    ejected, and the request would stay on the decode worker for that reason instead."""
    c = make(("p0", "d0"), disagg_max_prefill_backlog_tokens=40, health_interval_s=300.0)
    rng = random.Random(20261207)  # prompts no other test sends
    held = [rng.randrange(10, 600) for _ in range(48)]
    quick = [rng.randrange(10, 600) for _ in range(20)]
    after = [rng.randrange(10, 600) for _ in range(24)]
    p0 = by_name(c, "p0")
    backlogs = lambda: c.lt.call(lambda: {h.worker_id: h.prefill_backlog for h in c.router.registry.handles})  # noqa: E731
    reason = lambda r: c.metric("pdcluster_router_decode_prefills_total", {"reason": r})  # noqa: E731
    assert (reason("backlog"), reason("short")) == (0, 0)

    p0.pause()
    with ThreadPoolExecutor(1) as pool:
        try:
            first = pool.submit(final, c, held, 6)
            assert wait_until(lambda: backlogs()["p0"] == len(held), 30), backlogs()
            assert c.metric("pdcluster_router_worker_prefill_backlog_tokens",
                            {"worker": "p0", "address": p0.address, "role": "prefill"}) == len(held)
            out = final(c, quick)
            assert not out[-1].route.disaggregated and out[-1].route.decode_worker_id == "d0"
            assert tokens(out) == reference.tokens(quick, 4)
            assert reason("backlog") == 1 and not first.done()
        finally:
            p0.resume()
        out = first.result(timeout=120)
    assert out[-1].route.disaggregated and out[-1].route.prefill_worker_id == "p0"
    assert tokens(out) == reference.tokens(held, 6)
    assert wait_until(lambda: set(backlogs().values()) == {0}, 30), backlogs()

    out = final(c, after)
    assert out[-1].route.disaggregated
    assert tokens(out) == reference.tokens(after, 4)
    assert reason("backlog") == 1


def test_backlog_rule_skips_a_decode_worker_with_requests_in_flight(make, reference):
    """disagg_max_decode_inflight=0: the prefill worker is behind (stopped, holding a prompt over
    the limit), and the first request is prefilled by the idle decode worker; while that one is
    still in flight there (the decode worker stopped too), the next waits for the prefill worker
    instead of stalling it. Both answer as the model would, the second disaggregated."""
    c = make(("p0", "d0"), disagg_max_prefill_backlog_tokens=40, disagg_max_decode_inflight=0,
             health_interval_s=300.0)
    rng = random.Random(20261208)  # prompts no other test sends
    held = [rng.randrange(10, 600) for _ in range(48)]
    first_quick = [rng.randrange(10, 600) for _ in range(20)]
    second_quick = [rng.randrange(10, 600) for _ in range(21)]
    p0, d0 = by_name(c, "p0"), by_name(c, "d0")
    backlogs = lambda: c.lt.call(lambda: {h.worker_id: h.prefill_backlog for h in c.router.registry.handles})  # noqa: E731
    inflight = lambda: c.lt.call(lambda: {h.worker_id: h.num_inflight for h in c.router.registry.handles})  # noqa: E731
    reason = lambda r: c.metric("pdcluster_router_decode_prefills_total", {"reason": r})  # noqa: E731

    p0.pause()
    d0.pause()
    with ThreadPoolExecutor(3) as pool:
        try:
            held_f = pool.submit(final, c, held, 6)
            assert wait_until(lambda: backlogs()["p0"] == len(held), 30), backlogs()
            first_f = pool.submit(final, c, first_quick, 4)
            assert wait_until(lambda: inflight()["d0"] == 1, 30), inflight()
            assert reason("backlog") == 1
            second_f = pool.submit(final, c, second_quick, 4)
            # Not the busy decode worker's: it queues behind the held prompt on the prefill worker.
            assert wait_until(lambda: backlogs()["p0"] == len(held) + len(second_quick), 30), backlogs()
            assert reason("backlog") == 1 and inflight()["d0"] == 1
        finally:
            d0.resume()
            p0.resume()
        first, second, held_out = (f.result(timeout=120) for f in (first_f, second_f, held_f))
    assert not first[-1].route.disaggregated and first[-1].route.decode_worker_id == "d0"
    assert second[-1].route.disaggregated and second[-1].route.prefill_worker_id == "p0"
    assert tokens(first) == reference.tokens(first_quick, 4)
    assert tokens(second) == reference.tokens(second_quick, 4)
    assert tokens(held_out) == reference.tokens(held, 6)
    assert wait_until(lambda: set(backlogs().values()) == {0}, 30), backlogs()
