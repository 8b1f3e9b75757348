"""Chaos between the router and its workers (tests/chaos/router_worker_rig.py): a fault on the
path to (or on the process of) the worker serving a request mid-stream. Every request ends by
its deadline with the right text (token-exact vs the offline engine) or a clear error, never
lost; afterwards no running request or KV block on any worker, no thread, listener, process or
/dev/shm segment of the run; and the fault shows in the router's migration counter or the
proxy's own counters. The reset case runs in the default suite, the whole matrix under -m slow."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import grpc
import pytest
from chaos.leaks import (
    ResultRow,
    ended_by_reason,
    ended_delta,
    leftover_processes,
    shm_segments,
    worker_leaks,
)
from chaos.mark_hold_pool import MarkHoldPool
from chaos.router_worker_rig import MARKS, MAX_TOKENS, PROMPT, Rig, close_rig, make_rig, run_request
from real_router_cluster import WorkerProc, wait_until
from serve_procs import descendants

from pdcluster._proto import common_pb2, router_pb2, router_pb2_grpc

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
def rig(loop_thread, pool: MarkHoldPool, demo_model: str, reference) -> Iterator[Rig]:
    reference.tokens(PROMPT, MAX_TOKENS)  # the offline engine loads before the rig's thread baseline (tqdm)
    rig = make_rig(loop_thread, pool.take_named(["c0", "c1"]), demo_model)
    try:
        yield rig
    finally:
        left = close_rig(rig)
        pool.revive()
        assert left == [], left


def _reset(rig: Rig, w: WorkerProc) -> None:
    rig.proxy_of(w).reset()


def _reset_once(rig: Rig, w: WorkerProc) -> None:
    rig.proxy_of(w).reset(refuse_new=False)  # the connections break; a reconnect gets through


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
    "reset (RST), reconnect allowed": (_reset_once, "path router->worker"),
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
            f"corrupted {sum(s['corrupted'] for s in snaps)}, truncated {sum(s['truncated'] for s in snaps)}" \
            + (f"; {out.detail[:200]}" if out.end != "right" else "")
    chaos_rows.append(ResultRow(name, role, 1, out.end == "right", out.end == "error", out.end == "lost", leaks,
                                out.recover_s, shown))
    assert out.end in ("right", "error"), out
    assert leaks == [], leaks
    assert moved >= 1 or out.end == "error", shown  # the fault shows in the router's counters


def test_smoke_reset_path_mid_stream(rig, reference, chaos_rows):
    """Default suite: the path to the serving worker resets mid-stream; the request moves and ends right."""
    _held_case(rig, reference, chaos_rows, "reset (RST)")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in HELD_FAULTS if n != "reset (RST)"])
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
    urls = [w.ready.get("metrics") for w in rig.workers]
    ended_before = ended_by_reason(urls)
    for p in rig.proxies:
        arm(p)
    before = rig.migrations()
    out = run_request(rig, want, None, held=False)
    for p in rig.proxies:
        p.clear()
    leaks = rig.leaks()
    ended = ended_delta(ended_before, ended_by_reason(urls))
    fwd = sum(p.snapshot()["forwarded"]["down"] for p in rig.proxies)
    chaos_rows.append(ResultRow(name, "path router->worker", 1, out.end == "right", out.end == "error",
                                out.end == "lost", leaks, out.recover_s,
                                f"proxy forwarded {fwd} B down; no migration; worker requests_ended "
                                + ", ".join(f"{k} +{v:g}" for k, v in ended.items())))
    assert out.end == "right", out
    assert rig.migrations() == before and leaks == []
    assert not any(ended.values()), ended  # slow is not failed: no leg ended at a deadline or under a lost stream


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="known gap: plaintext internal gRPC (--insecure-internal) has no end-to-end "
                   "integrity, so one bit flipped in a token id reaches the client unnoticed; the mTLS default "
                   "fails any flipped byte (test_chaos_router_worker_tls.py)")
def test_plaintext_token_bit_flip(rig, reference, chaos_rows):
    """One bit of the first token id in the worker's reply (found right after the request id, as
    protobuf writes field 1 then field 2) flipped on the plaintext path: HTTP/2 and protobuf both
    still parse, the token is another valid id. Recorded as a row; strict xfail: the day the
    internal plane gets a checksum this test passes and must lose its mark."""
    from chaos.router_worker_rig import new_request_id

    want = reference.tokens(PROMPT, MAX_TOKENS)
    rid = new_request_id(held=False)
    for p in rig.proxies:
        p.corrupt_after("down", rid.encode() + b"\x12", 1)  # field 2 (token_ids) tag, length, first token
    out = run_request(rig, want, None, held=False, request_id=rid)
    for p in rig.proxies:
        p.clear()
    leaks = rig.leaks()
    hit = sum(p.snapshot()["corrupted"] for p in rig.proxies)
    chaos_rows.append(ResultRow("one bit of a token id, plaintext (--insecure-internal)", "path router->worker", 1,
                                out.end == "right", out.end == "error", out.end == "lost", leaks, out.recover_s,
                                f"proxy corrupted {hit}; {out.detail[:80] or 'no error'}"))
    assert hit == 1 and leaks == []
    assert out.end in ("right", "error"), out


# -- the router process itself ------------------------------------------------------------------
ROUTER_REQUEST_TIMEOUT_S = 20.0  # the router's deadline on its worker legs (propagated by gRPC)


def _start_router(workers: list[WorkerProc], model: str) -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "router", "--workers", ",".join(w.address for w in workers),
           "--model", model, "--grpc-port", "0", "--http-port", "0", "--insecure-internal", "--health-interval",
           "0.1", "--request-timeout", str(ROUTER_REQUEST_TIMEOUT_S), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True, env={**os.environ, "PDCLUSTER_DEVICE": "cpu"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put("")], daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=120)
        except queue.Empty:
            line = ""
        if line.startswith("PDCLUSTER_READY "):
            return proc, json.loads(line.split(" ", 1)[1])
        if not line:
            proc.kill()
            proc.wait(10)
            raise RuntimeError("router did not come up")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_router_process_killed_or_stopped(pool, demo_model, reference, chaos_rows, sig):
    """The router dies (or hangs) while a request is held mid-stream on a worker: the client gets a
    clear error (UNAVAILABLE, or its own deadline), and the worker frees the request by itself: the
    connection closes (SIGKILL), or the router's deadline on the leg passes (SIGSTOP, no SIGCONT)."""
    workers = pool.take_named(["c0", "c1"])
    proc, ready = _start_router(workers, demo_model)
    tree = [proc.pid, *descendants(proc.pid)]
    try:
        channel = grpc.insecure_channel(ready["grpc"])
        stub = router_pb2_grpc.RouterStub(channel)
        warm = router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=PROMPT),
                                          sampling_params=common_pb2.SamplingParams(max_tokens=1))
        assert wait_until(lambda: _ok(stub, warm), 60, 0.2), "router never served"
        stream = stub.Generate(router_pb2.GenerateRequest(
            request_id=f"mig-{uuid.uuid4().hex[:12]}", prompt_token_ids=router_pb2.TokenIds(ids=PROMPT),
            sampling_params=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            stream=True), timeout=10.0)
        got: list[int] = []
        while len(got) < MARKS[0]:
            got += next(stream).token_ids
        assert got == reference.tokens(PROMPT, MAX_TOKENS)[:MARKS[0]]
        urls = [w.ready.get("metrics") for w in workers]
        ended_before = ended_by_reason(urls)
        os.kill(proc.pid, sig)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for r in stream:
                got += r.token_ids
        code = info.value.code()
        leaks = []
        for w in workers:  # freed by the worker itself: nothing resumes the router
            leaks += [f"{w.name} {x}" for x in worker_leaks(w.address, w.ready.get("metrics"),
                                                            timeout=ROUTER_REQUEST_TIMEOUT_S + 40)]
        recover = time.monotonic() - t0
        # The worker counts the leg it ended: at the router's deadline on it, or under the lost stream.
        ended: dict[str, float] = {}

        def counted() -> bool:
            ended.update(ended_delta(ended_before, ended_by_reason(urls)))
            return sum(ended.values()) >= 1

        wait_until(counted, 30, 0.1)
        channel.close()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    left = leftover_processes(tree)
    chaos_rows.append(ResultRow(sig.name, "router process", 1, 0, int(code in (grpc.StatusCode.UNAVAILABLE,
                                grpc.StatusCode.DEADLINE_EXCEEDED)), 0, leaks + [f"process {p}" for p in left],
                                recover, f"client {code.name}; worker blocks freed after {recover:.1f} s; worker "
                                "requests_ended " + ", ".join(f"{k} +{v:g}" for k, v in ended.items())
                                + ("; worker WARNING 'request stream from ipv4:127.0.0.1:PORT ended with 1 "
                                   "request(s) running'" if sig == signal.SIGKILL else "")))
    assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), code
    assert leaks == [] and left == []
    assert sum(ended.values()) == 1, ended  # the held leg, counted once by the worker that ended it
    if sig == signal.SIGKILL:  # the worker names the router whose stream ended under a running request
        assert any("request stream from" in w.stderr_tail(400) for w in workers), [w.stderr_tail(5) for w in workers]


def _ok(stub, req) -> bool:
    try:
        return any(r.finished for r in stub.Generate(req, timeout=10))
    except grpc.RpcError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("name", ["reset (RST)", "blackhole", "SIGKILL"])
def test_four_streams_one_fault(rig, reference, chaos_rows, name):
    """Four held streams at once (two per worker), one fault on the worker with most of them."""
    from chaos.router_worker_rig import run_many

    fault, role = HELD_FAULTS[name]
    want = reference.tokens(PROMPT, MAX_TOKENS)
    before = rig.migrations()
    outs = run_many(rig, want, 4, fault)
    for p in rig.proxies:
        p.clear()
    for w in rig.workers:
        w.resume()
    leaks = rig.leaks()
    ends = [o.end for o in outs]
    moved = rig.migrations() - before
    chaos_rows.append(ResultRow(f"{name}, 4 streams", role, 4, ends.count("right"), ends.count("error"),
                                ends.count("lost"), leaks, max(o.recover_s for o in outs),
                                f"router migrations +{moved:g}" + "".join(f"; {o.detail[:150]}" for o in outs if o.end == "error")))
    assert ends.count("lost") == 0, [o.detail for o in outs]
    assert leaks == [], leaks
