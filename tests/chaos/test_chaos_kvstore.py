"""Chaos between a worker (an in-process engine with the store connector) and the kvstore: the
FaultProxy in front of the master (the connector's `master` option is the proxy's address), and
SIGKILL / SIGSTOP of the master or the storage node. A first engine stores a prompt's blocks
(no fault); a fresh engine then serves the same prompt under the fault, so its lookups and
loads meet it. Every request ends with the right text (the store is a cache: recompute) or a
clear KV-transfer error ("fail" policy); afterwards the engine has no block used and nothing
waiting for remote KV, and the fault shows in its connector counters. Processes are the
LocalStores' own, stopped by pid (its stop() also removes a killed node's /dev/shm segments,
which are checked before that)."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from chaos.fault_proxy import FaultProxy
from chaos.leaks import ResultRow, shm_segments

from pdcluster.cluster.store_procs import LocalStores
from pdcluster.config import EngineArgs
from pdcluster.connectors import engine_connector_factory
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.sampling_params import SamplingParams

RPC_TIMEOUT_S = 2.0
PROMPT = [random.Random(7).randrange(3, 500) for _ in range(4 * 16 + 5)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _engine(model: str, options: dict[str, Any] | None) -> LLMEngine:
    args = EngineArgs(model=model, num_kv_blocks=64, max_model_len=512, block_size=16, seed=0, dtype="float32",
                      kv_connector="store" if options is not None else None, kv_role="both",
                      kv_connector_options=options)
    return LLMEngine.from_engine_args(args, connector=engine_connector_factory if options is not None else None)


def _generate(engine: LLMEngine, rid: str, timeout_s: float = 120.0) -> Any:
    req, text = engine.prepare_request(PROMPT, GREEDY, rid, None, None)
    engine.add_prepared(req, text)
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, f"{rid} did not finish by its deadline"
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return engine.get_final(rid)


def _settle(engine: LLMEngine, timeout_s: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
    s = engine.get_stats()
    return [f"{k}={s[k]}" for k in ("kv_blocks_used", "num_waiting_for_remote_kv") if s.get(k)]


@pytest.fixture(scope="module")
def want(demo_model: str) -> list[int]:
    ref = _engine(demo_model, None)
    try:
        return list(_generate(ref, "ref").outputs[0].token_ids)
    finally:
        ref.shutdown()


@pytest.fixture
def store(demo_model: str, tmp_path) -> Iterator[tuple[LocalStores, FaultProxy]]:
    """A master and one node, the prompt's blocks stored through the proxy (not yet faulted)."""
    stores = LocalStores(str(tmp_path / "stores"))
    proxy = None
    try:
        master = stores.kvstore(node_size="64M")
        proxy = FaultProxy(master)
        a = _engine(demo_model, {"master": proxy.addr, "namespace": "chaos"})
        try:
            _generate(a, "seed")
            assert _settle(a) == []
            saved = a.get_stats()["kv_connector"]
            assert saved.get("store_put_stored", 0) >= 4, saved
        finally:
            a.shutdown()
        yield stores, proxy
    finally:
        if proxy is not None:
            proxy.close()
        stores.stop()


def _signal(which: int, sig: signal.Signals) -> Callable[[LocalStores, FaultProxy], None]:
    def fault(stores: LocalStores, proxy: FaultProxy) -> None:
        os.kill(stores.started[which].pid, sig)
        if sig == signal.SIGKILL:
            stores.started[which].wait(10)

    return fault


MASTER, NODE = 0, 1
# A node's objects are read from its /dev/shm segment when the reader shares the host (use_shm,
# the default), so its process is out of the read path; "TCP reads" puts it back in.
TCP = {"use_shm": False}
FAULTS: dict[str, tuple[Callable[[LocalStores, FaultProxy], None], str] | tuple[Any, str, dict]] = {
    "reset (RST)": (lambda s, p: p.reset(), "path worker->kvstore master"),
    "blackhole": (lambda s, p: p.blackhole(), "path worker->kvstore master"),
    "corrupt master->worker": (lambda s, p: p.corrupt("down", 0), "path worker->kvstore master"),
    "truncate master->worker": (lambda s, p: p.truncate("down", 0), "path worker->kvstore master"),
    "delay 50 ms/chunk": (lambda s, p: p.delay(50), "path worker->kvstore master"),
    "SIGKILL master": (_signal(MASTER, signal.SIGKILL), "kvstore master"),
    "SIGSTOP master": (_signal(MASTER, signal.SIGSTOP), "kvstore master"),
    "SIGKILL node": (_signal(NODE, signal.SIGKILL), "kvstore node"),
    "SIGSTOP node": (_signal(NODE, signal.SIGSTOP), "kvstore node"),
    "SIGKILL node, TCP reads": (_signal(NODE, signal.SIGKILL), "kvstore node", TCP),
    "SIGSTOP node, TCP reads": (_signal(NODE, signal.SIGSTOP), "kvstore node", TCP),
}


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("name", list(FAULTS))
def test_kvstore_fault_matrix(demo_model, store, want, chaos_rows, name, policy):
    stores, proxy = store
    fault, role, *extra = FAULTS[name]
    b = _engine(demo_model, {"master": proxy.addr, "namespace": "chaos", "rpc_timeout_s": RPC_TIMEOUT_S,
                             "failure_policy": policy, **(extra[0] if extra else {})})
    pids = [p.pid for p in stores.started]
    try:
        before = dict(b.get_stats()["kv_connector"])
        fault(stores, proxy)
        t0 = time.monotonic()
        out = _generate(b, f"chaos-{policy}")
        took = time.monotonic() - t0
        leaks = _settle(b)
        after = b.get_stats()["kv_connector"]
    finally:
        proxy.clear()
        for p in stores.started:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        b.shutdown()
    got = list(out.outputs[0].token_ids)
    if out.outputs[0].finish_reason == "error":
        end = "error" if "KV transfer failed" in (out.error or "") else "lost"
    else:
        end = "right" if got == want else "lost"
    killed = [pid for pid, p in zip(pids, stores.started) if p.poll() is not None]
    # A SIGKILLed node cannot unlink its segments (LocalStores.stop removes them): recorded, not failed.
    orphans = shm_segments(killed)
    if orphans:
        stores.stop()  # the launcher's cleanup of its killed children
        orphans_after = shm_segments(killed)
        assert orphans_after == [], orphans_after
    changed = {k: v - before.get(k, 0) for k, v in after.items()
               if isinstance(v, (int, float)) and v != before.get(k, 0) and ("fail" in k or "error" in k)}
    shown = ", ".join(f"{k} +{v:g}" for k, v in sorted(changed.items())) or "no error counter"
    hits = after.get("store_load_blocks", 0) - before.get("store_load_blocks", 0)
    timed = _load_count(after) - _load_count(before)  # -> transfer_duration_seconds{op="load"}
    chaos_rows.append(ResultRow(f"{name} ({policy})", role, 1, end == "right", end == "error", end == "lost",
                                leaks, took,
                                f"{shown}; blocks loaded {hits:g}, transfer_duration count +{timed}"
                                + (f"; killed node's shm segments {len(orphans)} until LocalStores.stop removed them"
                                   if orphans else "")))
    assert end in ("right", "error"), (end, out.error, got, want)
    if policy == "recompute":
        assert end == "right", out.error
    assert leaks == []
    whole = hits and not changed.get("store_load_failed_blocks")
    assert timed == (1 if whole else 0), (timed, hits, changed)  # timed: loads whose every block landed


def _load_count(stats: dict[str, Any]) -> int:
    return sum(stats.get("store_load_seconds", {}).get("counts", ()))
