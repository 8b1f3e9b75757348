"""Router -> worker chaos rig: real `serve-worker` processes (demo model, CPU, mark_hold: a "mig-"
request stops at output 4 until something ends it), each behind its own FaultProxy, and an
in-process router that knows the workers only by their proxies' addresses. A scenario opens one
stream, reads tokens up to the mark (so the request is held on the worker serving it: the fault
lands mid-request however fast the machine is), applies a fault to that worker or its path,
reads the rest and classifies the end: right text (token-exact vs the offline engine), a clear
error, or lost. Then it undoes the fault and checks for leaks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from chaos.fault_proxy import FaultProxy
from chaos.leaks import Baseline, worker_leaks
from real_router_cluster import Cluster, LoopThread, WorkerProc, wait_until, worker_stats

from pdcluster._proto import common_pb2, router_pb2

MARKS = (4,)
PROMPT = [21, 22, 23, 24]
MAX_TOKENS = 24
STALL_S = 3.0  # the router moves a leg silent this long (a blackholed or SIGSTOPped peer)
DEADLINE_S = 120.0


@dataclass
class Outcome:
    end: str  # right | error | lost
    detail: str
    tokens: list[int]
    recover_s: float
    route: Any = None


@dataclass
class Rig:
    cluster: Cluster
    workers: list[WorkerProc]
    proxies: list[FaultProxy]
    baseline: Baseline = field(default_factory=Baseline)
    tls: Any = None  # the router's TLSConfig when the workers serve mutual TLS; the rig asks with it

    def stats(self, address: str) -> Any:
        """A worker's own Stats, asked directly (with the router's certificate under mTLS)."""
        return tls_stats(address, self.tls)

    def proxy_of(self, w: WorkerProc) -> FaultProxy:
        return self.proxies[self.workers.index(w)]

    def migrations(self) -> float:
        text = self.cluster.metrics_text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdcluster_router_migrations_total{"))

    def serving(self, timeout: float = 30.0) -> WorkerProc:
        """The worker that runs the one request (asked directly, not through a proxy)."""
        found: list[WorkerProc] = []

        def one() -> bool:
            found[:] = [w for w in self.workers if w.alive and not w.paused and _running(self, w) == 1]
            return len(found) == 1

        assert wait_until(one, timeout), [(w.name, w.alive) for w in self.workers]
        return found[0]

    def leaks(self) -> list[str]:
        out = []
        for w in self.workers:
            if w.alive:
                out += [f"{w.name} {x}" for x in worker_leaks(w.address, w.ready.get("metrics"), stats=self.stats)]
        return out


def tls_stats(address: str, tls: Any = None) -> Any:
    """Stats of the worker at address: plaintext, or over TLS with this client TLSConfig."""
    if tls is None:
        return worker_stats(address)
    from pdcluster._proto import worker_pb2, worker_pb2_grpc
    from pdcluster.worker.tls import channel_credentials, channel_tls_options

    with grpc.secure_channel(address, channel_credentials(tls), channel_tls_options(tls)) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5.0)


def is_idle_with(tls: Any) -> Callable[[str], bool]:
    def idle(address: str) -> bool:
        try:
            s = tls_stats(address, tls)
        except grpc.RpcError:
            return False
        return s.num_running == 0 and s.num_waiting == 0 and s.num_kv_blocks_used == 0

    return idle


def _running(rig: Rig, w: WorkerProc) -> int:
    try:
        return rig.stats(w.address).num_running
    except grpc.RpcError:
        return -1


def make_rig(lt: LoopThread, workers: list[WorkerProc], model: str, **overrides: Any) -> Rig:
    from pdcluster.router.app import Router
    from pdcluster.router.config import RouterConfig

    baseline = Baseline()
    proxies = [FaultProxy(w.address) for w in workers]
    config = RouterConfig(**{
        "workers": tuple(p.addr for p in proxies), "model": model, "grpc_port": 0, "http_port": 0,
        "health_interval_s": 0.1, "health_timeout_s": 1.0, "request_timeout_s": DEADLINE_S, "policy": "round_robin",
        "stall_timeout_s": STALL_S, "max_migrations": 2, **overrides})
    router = Router(config)
    lt.run(router.start())
    rig = Rig(Cluster(lt, router, workers), workers, proxies, baseline, tls=config.worker_tls)
    assert rig.cluster.wait_healthy(len(workers)) and rig.cluster.wait_settled(), "workers not healthy via proxies"
    return rig


def close_rig(rig: Rig) -> list[str]:
    """Stop the router and the proxies; what the test process still has open that the rig made."""
    rig.cluster.close()
    for p in rig.proxies:
        p.close()
    left = [f"thread {t}" for t in rig.baseline.leftover_threads()]
    return left + [f"listener {a}:{p}" for a, p in rig.baseline.leftover_listeners()]


def sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def new_request_id(held: bool) -> str:
    return f"{'mig' if held else 'chaos'}-{uuid.uuid4().hex[:12]}"


def run_request(rig: Rig, want: list[int], fault: Callable[[Rig, WorkerProc], None] | None,
                held: bool = True, request_id: str | None = None) -> Outcome:
    """One stream; with held=True the fault is applied once the client read MARKS[0] tokens and the
    request is held on its worker; with held=False it runs under whatever the test armed before."""
    rid = request_id or new_request_id(held)
    stream = rig.cluster.stub.Generate(router_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=router_pb2.TokenIds(ids=PROMPT), sampling_params=sampling(),
        stream=True), timeout=DEADLINE_S)
    got: list[int] = []
    last = None
    t0 = time.monotonic()
    try:
        if held:
            while len(got) < MARKS[0]:
                last = next(stream)
                got += last.token_ids
            t0 = time.monotonic()
            assert fault is not None
            fault(rig, rig.serving())
        for last in stream:
            got += last.token_ids
    except grpc.RpcError as e:
        code = e.code()
        clear = code is not None and code != grpc.StatusCode.UNKNOWN and bool(e.details())
        return Outcome("error" if clear else "lost", f"{code}: {e.details()}", got, time.monotonic() - t0)
    recover = time.monotonic() - t0
    if last is None or not last.finished:
        return Outcome("lost", "stream ended without a final response", got, recover)
    if last.finish_reason == common_pb2.FINISH_REASON_ERROR:
        return Outcome("error" if last.error_message else "lost", last.error_message, got, recover, last.route)
    if got == want and last.finish_reason == common_pb2.FINISH_REASON_LENGTH:
        return Outcome("right", "", got, recover, last.route)
    return Outcome("lost", f"wrong text: {got} != {want}", got, recover, last.route)


def run_many(rig: Rig, want: list[int], n: int, fault: Callable[[Rig, WorkerProc], None]) -> list[Outcome]:
    """n streams at once (round robin spreads them); each is held at MARKS[0] on its worker; once
    all are, the fault hits the worker running most of them. The others stay held until the stall
    watch moves them (a hold looks like a stall), so every stream also survives one move."""
    import threading

    streams = [rig.cluster.stub.Generate(router_pb2.GenerateRequest(
        request_id=f"mig-{uuid.uuid4().hex[:12]}", prompt_token_ids=router_pb2.TokenIds(ids=PROMPT),
        sampling_params=sampling(), stream=True), timeout=DEADLINE_S) for _ in range(n)]
    got: list[list[int]] = [[] for _ in range(n)]
    held = threading.Barrier(n + 1, timeout=DEADLINE_S)
    outs: list[Outcome | None] = [None] * n
    t0 = [0.0]

    def read(i: int) -> None:
        last = None
        try:
            while len(got[i]) < MARKS[0]:
                last = next(streams[i])
                got[i] += last.token_ids
            held.wait()
            for last in streams[i]:
                got[i] += last.token_ids
        except grpc.RpcError as e:
            clear = e.code() not in (None, grpc.StatusCode.UNKNOWN) and bool(e.details())
            outs[i] = Outcome("error" if clear else "lost", f"{e.code()}: {e.details()}", got[i], 0.0)
            return
        except threading.BrokenBarrierError:
            outs[i] = Outcome("lost", "never reached the mark", got[i], 0.0)
            return
        recover = time.monotonic() - t0[0]
        if last is None or not last.finished:
            outs[i] = Outcome("lost", "no final response", got[i], recover)
        elif last.finish_reason == common_pb2.FINISH_REASON_ERROR:
            outs[i] = Outcome("error" if last.error_message else "lost", last.error_message, got[i], recover)
        elif got[i] == want and last.finish_reason == common_pb2.FINISH_REASON_LENGTH:
            outs[i] = Outcome("right", "", got[i], recover, last.route)
        else:
            outs[i] = Outcome("lost", f"wrong text: {got[i]}", got[i], recover, last.route)

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    held.wait()
    counts = {w.name: _running(rig, w) for w in rig.workers}
    target = max(rig.workers, key=lambda w: counts[w.name])
    t0[0] = time.monotonic()
    fault(rig, target)
    for t in threads:
        t.join(DEADLINE_S + 10)
    return [o if o is not None else Outcome("lost", "reader still running", [], 0.0) for o in outs]
