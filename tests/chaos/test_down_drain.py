"""`pdcluster down` drains before it stops (cluster/ray_teardown.py, router/drain_workers.py).

The drain itself with real workers: a request held mid-stream on one of two mark_hold workers,
then drain_workers() through the router (as RouterActor.drain_workers does for `down`): both
workers answer Drain, turn NOT_SERVING and refuse new work; the held request is the one moved
at the drain timeout and, with every worker draining, ends with a clear error after its first
tokens (never lost), and nothing is left on either worker. The order of `down` (drain, then the
router, then the workers) is checked on a stand-in for Ray's API: it needs no Ray cluster."""

from __future__ import annotations

import pathlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from chaos.leaks import leftover_processes, shm_segments
from chaos.mark_hold_pool import MarkHoldPool
from chaos.router_worker_rig import MARKS, MAX_TOKENS, PROMPT, Rig, close_rig, make_rig, run_request
from grpc_health.v1 import health_pb2, health_pb2_grpc
from real_router_cluster import WorkerProc, wait_until

from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc


@pytest.fixture(scope="module")
def want(reference) -> list[int]:  # noqa: ANN001
    return reference.tokens(PROMPT, MAX_TOKENS)


@pytest.fixture(scope="module")
def pool(demo_model: str, key_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarkHoldPool]:
    pool = MarkHoldPool(demo_model, str(key_dir), tmp_path_factory.mktemp("down-drain-logs"),
                        [("d0", "both"), ("d1", "both")], MARKS)
    try:
        yield pool
    finally:
        pids = [w.pid for w in pool.workers if w.proc is not None]
        pool.close()
        assert leftover_processes(pids) == [] and shm_segments(pids) == []


@pytest.fixture
def rig(loop_thread, pool: MarkHoldPool, demo_model: str, want: list[int]) -> Iterator[Rig]:
    rig = make_rig(loop_thread, pool.take_named(["d0", "d1"]), demo_model)
    try:
        yield rig
    finally:
        left = close_rig(rig)  # the drained workers stay NOT_SERVING: the module's one such test
        assert left == [], left


def _health(w: WorkerProc) -> int:
    with grpc.insecure_channel(w.address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


@pytest.mark.slow
def test_drain_workers_through_the_router(rig: Rig, want: list[int]) -> None:
    from pdcluster.router.drain_workers import drain_workers

    drained: dict[str, Any] = {}

    def drain(rig: Rig, w: WorkerProc) -> None:
        drained["serving"] = w.address
        drained.update(rig.cluster.lt.run(drain_workers(rig.cluster.router.registry, 0.5), timeout=120))

    out = run_request(rig, want, drain)
    by_addr = {p.addr: w.address for p, w in zip(rig.proxies, rig.workers)}  # the router knows the proxies
    result = {by_addr[a]: r for a, r in drained.items() if a in by_addr}
    assert result[drained["serving"]] == {"finished": 0, "moved": 1}, drained
    assert all(r == {"finished": 0, "moved": 0} for a, r in result.items() if a != drained["serving"]), drained
    assert out.end == "error" and out.tokens == want[:len(out.tokens)] and len(out.tokens) >= MARKS[0], out
    for w in rig.workers:
        assert _health(w) == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(w.address) as ch, pytest.raises(grpc.RpcError) as e:
            sp = common_pb2.SamplingParams(max_tokens=2)
            list(worker_pb2_grpc.WorkerStub(ch).Generate(
                worker_pb2.WorkerGenerateRequest(prompt_token_ids=PROMPT, sampling_params=sp), timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
    assert wait_until(lambda: rig.leaks() == [], 60), rig.leaks()


class _FakeRay(types.ModuleType):
    """The slice of Ray's API ray_teardown._stop_actors uses, recording the calls in order."""

    def __init__(self, namespace: str, names: list[str]) -> None:
        super().__init__("ray")
        self.ns, self.live, self.calls = namespace, list(names), []
        self.util = types.SimpleNamespace(list_named_actors=lambda all_namespaces: [
            {"namespace": namespace, "name": n} for n in self.live])

    def get_actor(self, name: str, namespace: str) -> Any:
        fake = self

        class Actor:
            def __getattr__(self, method: str) -> Any:
                return types.SimpleNamespace(remote=lambda *a: fake.calls.append((name, method, a)) or (name, method))

        actor = Actor()
        actor.name = name  # type: ignore[attr-defined]
        return actor

    def get(self, ref: tuple[str, str], timeout: float) -> Any:
        return {"127.0.0.1:1": {"finished": 2, "moved": 1}} if ref[1] == "drain_workers" else {}

    def kill(self, actor: Any, no_restart: bool) -> None:
        self.calls.append((actor.name, "kill", ()))
        self.live.remove(actor.name)


def test_down_drains_before_stopping(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcluster.cluster import ray_teardown

    fake = _FakeRay("ns", ["ns:router", "ns:prefill-0", "ns:decode-0"])
    monkeypatch.setitem(sys.modules, "ray", fake)
    report: dict[str, Any] = {"actors": [], "placement_groups": [], "children": {}, "left": [], "drained": {}}
    ray_teardown._stop_actors("ns", 5.0, report, drain_timeout_s=7.0)
    order = [(n, m) for n, m, _ in fake.calls]
    assert order[0] == ("ns:router", "drain_workers") and fake.calls[0][2] == (7.0,)
    assert order[1] == ("ns:router", "stop")
    assert {o for o in order[2:4]} == {("ns:prefill-0", "stop"), ("ns:decode-0", "stop")}
    assert report["drained"] == {"127.0.0.1:1": {"finished": 2, "moved": 1}} and not report["left"]
    fake = _FakeRay("ns", ["ns:router", "ns:decode-0"])
    monkeypatch.setitem(sys.modules, "ray", fake)
    ray_teardown._stop_actors("ns", 5.0, report, drain_timeout_s=None)  # no drain asked
    assert [m for _, m, _ in fake.calls][0] == "stop"
