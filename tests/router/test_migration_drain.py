"""Graceful drain: the Drain RPC and SIGTERM on a worker stop admitting (UNAVAILABLE), report
NOT_SERVING, let running requests finish until --drain-timeout and end the rest with UNAVAILABLE,
which a router resumes on another worker (migration); then the process exits 0. A rolling restart
of every worker under steady load drops no request and every answer is the offline engine's.

Workers run through tests/chaos/mark_hold_cli.py: a "mig-" request stops at output length 4 until
its worker is drained or killed, so the drain always finds it running.
"""

from __future__ import annotations

import pathlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from chaos.mark_hold_pool import MarkHoldPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from real_router_cluster import Cluster, LoopThread, is_idle, router_cluster, wait_until, worker_stats

from pdcluster._proto import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

MARK = 4
DRAIN_TIMEOUT_S = 1.0
LENGTH = common_pb2.FINISH_REASON_LENGTH
PROMPT = [31, 32, 33]


@pytest.fixture(scope="module")
def drain_pool(demo_model: str, key_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarkHoldPool]:
    pool = MarkHoldPool(demo_model, str(key_dir), tmp_path_factory.mktemp("drain-logs"),
                        [(f"r{i}", "both") for i in range(3)], (MARK,),
                        extra_args=["--drain-timeout", str(DRAIN_TIMEOUT_S)])
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def make(loop_thread: LoopThread, drain_pool: MarkHoldPool, demo_model: str) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(names: tuple[str, ...] = ("r0", "r1", "r2"), **overrides: Any) -> Cluster:
        workers = drain_pool.take_named(names)
        c = router_cluster(loop_thread, workers, demo_model, request_timeout_s=120.0, **overrides)
        made.append(c)
        assert c.wait_healthy(len(workers)), "the workers did not become healthy"
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
        drain_pool.revive()


def sampling(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def tokens(out: list) -> list[int]:
    return [t for r in out for t in r.token_ids]


def test_drain_rpc_moves_what_still_runs(drain_pool, reference):
    (w,) = drain_pool.take_named(["r0"])
    with grpc.insecure_channel(w.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        held = stub.Generate(worker_pb2.WorkerGenerateRequest(
            request_id=f"mig-{uuid.uuid4().hex[:8]}", prompt_token_ids=PROMPT, sampling_params=sampling(40),
            stream=True), timeout=60)
        got = [next(held) for _ in range(MARK)]
        assert tokens(got) == reference.tokens(PROMPT, MARK)
        drained = stub.Drain(worker_pb2.DrainRequest(timeout_s=0.2), timeout=30)
        assert (drained.num_finished, drained.num_moved) == (0, 1)
        with pytest.raises(grpc.RpcError) as e:
            list(held)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(worker_pb2.WorkerGenerateRequest(
                request_id="after-drain", prompt_token_ids=PROMPT, sampling_params=sampling(2)), timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        assert wait_until(lambda: is_idle(w.address), 30)  # the moved request's blocks are free
    w.restart()  # a drained worker refuses until it is stopped


def test_sigterm_mid_stream_migrates_and_exits_zero(make, reference):
    c = make(("r0", "r1"))
    want = reference.generate(PROMPT, max_tokens=40)
    stream = c.stub.Generate(router_pb2.GenerateRequest(
        request_id=f"mig-{uuid.uuid4().hex[:12]}", prompt_token_ids=router_pb2.TokenIds(ids=PROMPT),
        sampling_params=sampling(40), stream=True), timeout=120)
    got: list = []
    while sum(len(r.token_ids) for r in got) < MARK:
        got.append(next(stream))
    assert wait_until(lambda: any(worker_stats(w.address).num_running == 1 for w in c.workers), 30)
    serving = next(w for w in c.workers if worker_stats(w.address).num_running == 1)
    serving.terminate()  # SIGTERM: drain, then exit
    got += list(stream)
    last = got[-1]
    assert last.finish_reason == LENGTH, last
    assert tokens(got) == list(want.token_ids) and "".join(r.text for r in got) == want.text
    assert last.route.num_migrations == 1 and last.route.decode_worker_id != serving.worker_id
    assert serving.proc.wait(30) == 0, serving.stderr_tail()
    assert c.metric("pdcluster_router_migrations_total", {"reason": "worker_lost"}) == 1


def test_rolling_restart_under_load_drops_nothing(make, reference):
    """Every worker in turn: SIGTERM (drain), exit, a new process on the same port, healthy again;
    meanwhile clients stream requests without pause. Each one must end with the right text."""
    prompts = [[40 + i, 7, 9, 11 + i] for i in range(4)]
    max_tokens = 48
    want = {tuple(p): reference.tokens(p, max_tokens) for p in prompts}
    c = make(policy="least_loaded")
    stop = threading.Event()
    results: list[tuple[bool, str]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            prompt = prompts[(i + n) % len(prompts)]
            n += 1
            try:
                out = list(c.stub.Generate(router_pb2.GenerateRequest(
                    prompt_token_ids=router_pb2.TokenIds(ids=prompt), sampling_params=sampling(max_tokens),
                    stream=True), timeout=120))
                ok = out[-1].finish_reason == LENGTH and tokens(out) == want[tuple(prompt)]
                why = "" if ok else f"finish {out[-1].finish_reason} {out[-1].error_message!r}"
            except grpc.RpcError as e:
                ok, why = False, f"{e.code().name}: {e.details()}"
            with lock:
                results.append((ok, why))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    try:
        for w in c.workers:
            # Let it serve something first, so the drain has requests to finish or move.
            wait_until(lambda w=w: worker_stats(w.address).num_running > 0, 10, interval=0.01)
            w.restart()
            assert c.wait_healthy(len(c.workers), 60), f"{w.name} did not rejoin"
        done = len(results)
        assert wait_until(lambda: len(results) >= done + 3, 60)  # the restarted cluster serves
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    failures = [why for ok, why in results if not ok]
    print(f"rolling restart: {len(results)} requests, {len(failures)} failed, "
          f"{c.metric('pdcluster_router_migrations_total', {'reason': 'worker_lost'}):g} migrated, "
          f"{c.metric('pdcluster_router_retries_total', {'role': 'decode'}):g} retried")
    assert not failures, failures
    assert len(results) >= 6
    for w in c.workers:
        assert wait_until(lambda w=w: is_idle(w.address), 30), worker_stats(w.address)
