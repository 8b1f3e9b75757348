"""Process faults in disaggregated serving (slow): a prefill worker p0 and decode workers d0, d1
(P2P connector, demo model, CPU, mark_hold: a "mig-" decode leg stops at output 4), an
in-process router with a stall timeout. While the request is held on its decode worker (the
hand-off done), the decode worker is SIGSTOPped, or the prefill worker is SIGKILLed /
SIGSTOPped. The held request looks stalled, so the router moves it after the stall timeout to
the other decode worker, which must continue without the prefill worker. Every request ends with the right text; after,
no running request, KV block or active lease on any live worker. (A decode worker SIGKILLed
mid-stream and a prefill worker dead before the first token: tests/router/test_migration_disagg.py.)"""

from __future__ import annotations

import json
import pathlib
import secrets
from collections.abc import Iterator

import pytest
from chaos.leaks import ResultRow, leftover_processes
from chaos.mark_hold_pool import MarkHoldPool
from chaos.router_worker_rig import MARKS, MAX_TOKENS, PROMPT, Rig, close_rig, make_rig, run_request
from real_router_cluster import WorkerProc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool(demo_model: str, key_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarkHoldPool]:
    pool = MarkHoldPool(demo_model, str(key_dir), tmp_path_factory.mktemp("chaos-disagg-logs"),
                        [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")], MARKS,
                        extra_args=["--kv-connector", "p2p"],
                        env={"PDCLUSTER_KV_CONNECTOR_OPTIONS": json.dumps({"params_secret": secrets.token_hex(32)})})
    pids: list[int] = []
    try:
        yield pool
    finally:
        pids = [w.pid for w in pool.workers if w.proc is not None]
        pool.close()
    assert leftover_processes(pids) == []


@pytest.fixture
def rig(loop_thread, pool: MarkHoldPool, demo_model: str, key_dir: pathlib.Path) -> Iterator[Rig]:
    rig = make_rig(loop_thread, pool.take_named(["p0", "d0", "d1"]), demo_model, key_dir=str(key_dir))
    try:
        yield rig
    finally:
        left = close_rig(rig)
        pool.revive()
        assert left == [], left


def _prefill(rig: Rig) -> WorkerProc:
    return next(w for w in rig.workers if w.name == "p0")


CASES = {
    "SIGSTOP decode": ("decode worker (disagg)", lambda rig, serving: serving.pause()),
    "SIGKILL prefill after hand-off": ("prefill worker (disagg)", lambda rig, serving: _prefill(rig).kill()),
    "SIGSTOP prefill after hand-off": ("prefill worker (disagg)", lambda rig, serving: _prefill(rig).pause()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_disagg_process_faults(rig, reference, chaos_rows, name):
    role, fault = CASES[name]
    want = reference.tokens(PROMPT, MAX_TOKENS)
    before = rig.migrations()
    out = run_request(rig, want, fault)
    for w in rig.workers:
        w.resume()
    leaks = rig.leaks()
    moved = rig.migrations() - before
    chaos_rows.append(ResultRow(name, role, 1, out.end == "right", out.end == "error", out.end == "lost", leaks,
                                out.recover_s, f"router migrations +{moved:g}; route {out.route}".replace("\n", " ")))
    assert out.end == "right", out
    assert out.route is not None and out.route.disaggregated
    assert leaks == [], leaks
    # The hold itself looks like a stall: the router moves the request to the other decode worker
    # after STALL_S in every case; with the prefill worker dead or stopped that worker computes the
    # prompt itself (a migration leg needs no prefill), and the text stays exact.
    assert moved == 1
