"""Chaos on tensor-parallel workers: two `serve-worker --tp 2` (demo model, CPU) behind the router
rig (tests/chaos/router_worker_rig.py); a request is held at output 4 on one of them, then that
worker's non-zero rank (its child process) is SIGKILLed or SIGSTOPped. The request ends with the
right text (migrated to the other TP worker) or a clear error; the faulted worker reports
NOT_SERVING (a stopped rank is found by the rank launcher, instead of blocking every collective
until the collective timeout while the worker still looks healthy), names the rank in its log,
and exits 0 on SIGTERM; afterwards no process of it (rank 0, the rank), no /dev/shm segment
of theirs, and no listener they held is left, and nothing runs on the other worker."""

from __future__ import annotations

import os
import pathlib
import signal
from collections.abc import Iterator

import grpc
import pytest
from chaos.leaks import ResultRow, leftover_processes, shm_segments
from chaos.mark_hold_pool import MarkHoldPool
from chaos.router_worker_rig import MARKS, MAX_TOKENS, PROMPT, Rig, close_rig, make_rig, run_request
from distributed.tp_procs import children_of
from grpc_health.v1 import health_pb2, health_pb2_grpc
from proc_sockets import listening
from real_router_cluster import WorkerProc, wait_until

COMMAND = "PDCLUSTER_CHAOS_TABLE=/tmp/chaos_tp.md .venv/bin/python -m pytest -m 'slow or not slow' tests/chaos/test_chaos_tp.py"


@pytest.fixture(scope="module")
def pool(demo_model: str, key_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarkHoldPool]:
    pool = MarkHoldPool(demo_model, str(key_dir), tmp_path_factory.mktemp("chaos-tp-logs"),
                        [("t0", "both"), ("t1", "both")], MARKS, extra_args=["--tp", "2"])
    try:
        yield pool
    finally:
        pids = [p for w in pool.workers if w.proc is not None for p in (w.pid, *children_of(w.pid))]
        pool.close()
        assert leftover_processes(pids) == []
        assert shm_segments(pids) == []


@pytest.fixture(scope="module")
def want(reference) -> list[int]:  # noqa: ANN001
    return reference.tokens(PROMPT, MAX_TOKENS)  # before any rig: its loader's threads are not the rig's


@pytest.fixture
def rig(loop_thread, pool: MarkHoldPool, demo_model: str, want: list[int]) -> Iterator[Rig]:
    rig = make_rig(loop_thread, pool.take_named(["t0", "t1"]), demo_model)
    try:
        yield rig
    finally:
        left = close_rig(rig)
        pool.revive()  # the faulted worker was stopped: started again for the next case
        assert left == [], left


def _health(w: WorkerProc) -> int:
    with grpc.insecure_channel(w.address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _rank_of(w: WorkerProc) -> int:
    ranks = [p for p in children_of(w.pid) if b"rank_main" in _cmdline(p)]
    assert len(ranks) == 1, (w.name, children_of(w.pid))
    return ranks[0]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _tp_case(rig: Rig, want: list[int], chaos_rows: list[ResultRow], sig: signal.Signals) -> None:
    before = rig.migrations()
    hit: dict[str, object] = {}

    def fault(rig: Rig, w: WorkerProc) -> None:
        rank = _rank_of(w)
        hit.update(worker=w, rank=rank, listeners=set(listening([w.pid, rank])))
        os.kill(rank, sig)

    out = run_request(rig, want, fault)
    w, rank = hit["worker"], hit["rank"]
    assert isinstance(w, WorkerProc) and isinstance(rank, int)
    # The instance is down: NOT_SERVING, the rank gone (a stopped one killed by the launcher),
    # rank 0 opened nothing new; the cause is in the worker's log.
    assert wait_until(lambda: _health(w) == health_pb2.HealthCheckResponse.NOT_SERVING, 60), "still SERVING"
    rank_left = leftover_processes([rank], timeout=60)
    new_listeners = sorted(set(listening([w.pid])) - hit["listeners"])
    log_named = f"tensor-parallel rank 1 (pid {rank})" in w.stderr_tail(200)
    w.stop(30)
    code = w.proc.returncode if w.proc is not None else None
    pids = [w.pid, rank]
    leaks = rig.leaks() + [f"process {p}" for p in leftover_processes(pids) + rank_left] \
        + [f"shm {s}" for s in shm_segments(pids)] + [f"listener {a}:{p}" for a, p in new_listeners] \
        + [f"listener {a}:{p} after exit" for a, p in listening(pids)]
    moved = rig.migrations() - before
    how = "stopped by SIGSTOP" if sig == signal.SIGSTOP else "exited with signal SIGKILL"
    chaos_rows.append(ResultRow(sig.name, "TP rank 1 of a --tp 2 worker", 1, out.end == "right", out.end == "error",
                                out.end == "lost", leaks, out.recover_s,
                                f"router migrations +{moved:g}; worker NOT_SERVING, log 'tensor-parallel rank 1 "
                                f"(pid N) {how}'; exit code {code}", command=COMMAND))
    assert out.end in ("right", "error"), out
    assert out.end == "error" or out.route is None or moved >= 1, out
    assert log_named, w.stderr_tail(40)
    assert code == 0, w.stderr_tail(40)
    assert leaks == [], leaks


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_tp_rank_fault_mid_request(rig, want, chaos_rows, sig) -> None:  # noqa: ANN001
    _tp_case(rig, want, chaos_rows, sig)
