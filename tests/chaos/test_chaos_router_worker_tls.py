"""Router <-> worker chaos over gRPC with mutual TLS (the default for serve/up's internal plane):
the same held-request faults as test_chaos_router_worker.py, the FaultProxy forwarding TLS
records it cannot read. A flipped byte now breaks a TLS record (its AEAD tag fails: the
connection ends with an alert) instead of an HTTP/2 frame, so corruption can never reach a
token: every row ends with the right text (migrated) or a clear error, and nothing is left on
the workers. The rig asks the workers' Stats with the router's certificate."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from chaos.leaks import leftover_processes, shm_segments
from chaos.mark_hold_pool import MarkHoldPool
from chaos.router_worker_rig import MARKS, MAX_TOKENS, PROMPT, Rig, close_rig, is_idle_with, make_rig
from chaos.test_chaos_router_worker import _held_case

from pdcluster.security.pki import Identity, init_pki
from pdcluster.worker.tls import TLSConfig

COMMAND = ("PDCLUSTER_CHAOS_TABLE=/tmp/chaos_tls.md .venv/bin/python -m pytest -m slow "
           "tests/chaos/test_chaos_router_worker_tls.py")
TLS_FAULTS = ("reset (RST)", "reset (RST), reconnect allowed", "blackhole", "corrupt worker->router", "corrupt router->worker", "truncate worker->router")


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> tuple[Identity, Identity]:
    ca = init_pki(tmp_path_factory.mktemp("chaos-pki") / "pki")
    return ca.issue("worker", "chaos-worker"), ca.issue("router", "chaos-router")


@pytest.fixture(scope="module")
def want(reference) -> list[int]:  # noqa: ANN001
    return reference.tokens(PROMPT, MAX_TOKENS)


@pytest.fixture(scope="module")
def pool(demo_model: str, key_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory,
         identities: tuple[Identity, Identity]) -> Iterator[MarkHoldPool]:
    w, _ = identities
    pool = MarkHoldPool(demo_model, str(key_dir), tmp_path_factory.mktemp("chaos-tls-logs"),
                        [("s0", "both"), ("s1", "both")], MARKS,
                        extra_args=["--tls-cert", w.cert, "--tls-key", w.key, "--tls-ca", w.ca])
    try:
        yield pool
    finally:
        pids = [w.pid for w in pool.workers if w.proc is not None]
        pool.close()
        assert leftover_processes(pids) == [] and shm_segments(pids) == []


@pytest.fixture
def rig(loop_thread, pool: MarkHoldPool, demo_model: str, identities, want: list[int]) -> Iterator[Rig]:  # noqa: ANN001
    _, r = identities
    tls = TLSConfig(ca=r.ca, cert=r.cert, key=r.key)
    # With 1 s a health check of the other worker timed out on the busy machine (TLS reconnects after
    # the fault) and ejected it: the row then ended 'no other healthy worker' instead of migrating.
    rig = make_rig(loop_thread, pool.take_named(["s0", "s1"], idle=is_idle_with(tls)), demo_model, worker_tls=tls,
                   health_timeout_s=5.0)
    try:
        yield rig
    finally:
        left = close_rig(rig)
        pool.revive()
        assert left == [], left


@pytest.mark.slow
@pytest.mark.parametrize("name", TLS_FAULTS)
def test_held_request_fault_matrix_mtls(rig, reference, chaos_rows, name) -> None:  # noqa: ANN001
    try:
        _held_case(rig, reference, chaos_rows, name)
    finally:
        if chaos_rows and chaos_rows[-1].fault == name:
            chaos_rows[-1].role += " (mTLS)"
            chaos_rows[-1].command = COMMAND
