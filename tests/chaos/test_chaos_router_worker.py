"""Chaos between the router and its workers (tests/chaos/router_worker_rig.py): a fault on the
path to (or on the process of) the worker serving a request mid-stream. Every request ends by
its deadline with the right text (token-exact vs the offline engine) or a clear error, never
lost; afterwards no running request or KV block on any worker, no thread, listener, process or
/dev/shm segment of the run; and the fault shows in the router's migration counter or the
proxy's own counters. Two cases run in the default suite, the whole matrix under -m slow."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator

import pytest
from chaos.leaks import ResultRow, leftover_processes, shm_segments
from chaos.mark_hold_pool import MarkHoldPool
from chaos.router_worker_rig import MARKS, MAX_TOKENS, PROMPT, Rig, close_rig, make_rig, run_request
from real_router_cluster import WorkerProc

FaultFn = Callable[[Rig, WorkerProc], None]


@pytest.fixture(scope="module")
def pool(demo_model: str, key_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarkHoldPool]:
    pool = MarkHoldPool(demo_model, str(key_dir), tmp_path_factory.mktemp("chaos-logs"),
                        [("c0", "both"), ("c1", "both")], MARKS)
    pids: list[int] = []
    try:
        yield pool
    finally:
        pids = [w.pid for w in pool.workers if w.proc is not None]
        pool.close()
    assert leftover_processes(pids) == []
    assert shm_segments(pids) == []


@pytest.fixture
def rig(loop_thread, pool: MarkHoldPool, demo_model: str) -> Iterator[Rig]:
    rig = make_rig(loop_thread, pool.take_named(["c0", "c1"]), demo_model)
    try:
        yield rig
    finally:
        left = close_rig(rig)
        pool.revive()
        assert left == [], left


def _reset(rig: Rig, w: WorkerProc) -> None:
    rig.proxy_of(w).reset()


def _blackhole(rig: Rig, w: WorkerProc) -> None:
    rig.proxy_of(w).blackhole()


def _truncate_down(rig: Rig, w: WorkerProc) -> None:
    rig.proxy_of(w).truncate("down", 0)


def _corrupt(direction: str) -> FaultFn:
    def fault(rig: Rig, w: WorkerProc) -> None:
        rig.proxy_of(w).corrupt(direction, 0)  # the first byte of the next chunk: a frame header

    return fault


def _sigkill(rig: Rig, w: WorkerProc) -> None:
    w.kill()


def _sigstop(rig: Rig, w: WorkerProc) -> None:
    w.pause()


HELD_FAULTS: dict[str, tuple[FaultFn, str]] = {
    "reset (RST)": (_reset, "path router->worker"),
    "blackhole": (_blackhole, "path router->worker"),
    "truncate worker->router": (_truncate_down, "path router->worker"),
    "corrupt worker->router": (_corrupt("down"), "path router->worker"),
    "corrupt router->worker": (_corrupt("up"), "path router->worker"),
    "SIGKILL": (_sigkill, "worker (both)"),
    "SIGSTOP": (_sigstop, "worker (both)"),
}


def _held_case(rig: Rig, reference, chaos_rows: list[ResultRow], name: str) -> None:
    fault, role = HELD_FAULTS[name]
    want = reference.tokens(PROMPT, MAX_TOKENS)
    before = rig.migrations()
    out = run_request(rig, want, fault)
    for p in rig.proxies:  # undo the fault, then nothing may be left over
        p.clear()
    for w in rig.workers:
        w.resume()
    leaks = rig.leaks()
    moved = rig.migrations() - before
    snaps = [p.snapshot() for p in rig.proxies]
    shown = f"router migrations +{moved:g}; proxy resets {sum(s['resets'] for s in snaps)}, " \
            f"corrupted {sum(s['corrupted'] for s in snaps)}, truncated {sum(s['truncated'] for s in snaps)}"
    chaos_rows.append(ResultRow(name, role, 1, out.end == "right", out.end == "error", out.end == "lost", leaks,
                                out.recover_s, shown))
    assert out.end in ("right", "error"), out
    assert leaks == [], leaks
    assert moved >= 1 or out.end == "error", shown  # the fault shows in the router's counters


@pytest.mark.parametrize("name", ["reset (RST)", "blackhole"])
def test_smoke_held_request_survives(rig, reference, chaos_rows, name):
    """Default suite: a reset and a blackholed path mid-stream; the request moves and ends right."""
    _held_case(rig, reference, chaos_rows, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in HELD_FAULTS if n not in ("reset (RST)", "blackhole")])
def test_held_request_fault_matrix(rig, reference, chaos_rows, name):
    _held_case(rig, reference, chaos_rows, name)


def _arm_delay(p) -> None:
    p.delay(20)


def _arm_bandwidth(p) -> None:
    p.bandwidth(20_000)


@pytest.mark.slow
@pytest.mark.parametrize("name,arm", [("delay 20 ms/chunk", _arm_delay), ("bandwidth 20 KB/s", _arm_bandwidth)])
def test_degraded_path_still_right(rig, reference, chaos_rows, name, arm):
    """A slow path is not a fault to recover from: the whole request runs under it, on its first
    worker, with the right text and no migration."""
    want = reference.tokens(PROMPT, MAX_TOKENS)
    for p in rig.proxies:
        arm(p)
    before = rig.migrations()
    out = run_request(rig, want, None, held=False)
    for p in rig.proxies:
        p.clear()
    leaks = rig.leaks()
    fwd = sum(p.snapshot()["forwarded"]["down"] for p in rig.proxies)
    chaos_rows.append(ResultRow(name, "path router->worker", 1, out.end == "right", out.end == "error",
                                out.end == "lost", leaks, out.recover_s, f"proxy forwarded {fwd} B down; no migration"))
    assert out.end == "right", out
    assert rig.migrations() == before and leaks == []
