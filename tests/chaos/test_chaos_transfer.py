"""Chaos on the P2P transfer plane: the FaultProxy between the consumer (decode) and the producer's
(prefill) data plane. The consumer learns the data-plane address from the producer's handshake
body, so the producer's agent advertises the proxy's port (as tests/connectors/test_p2p_mac.py
does with its TamperProxy); the side channel (CURVE) stays direct. Engines run in this process.

Each fault is armed before the hand-off, so the whole pull runs under it. Under the "recompute"
policy the decode leg's output equals the one-engine output; under "fail" it ends with a clear
KV-transfer error. Afterwards: no KV block used, nothing held for a transfer or waiting for remote
KV on either engine, no active lease on the producer; the fault shows in the loader's counters
(loads_failed) and its last error for the request."""

from __future__ import annotations

import pathlib
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from chaos.fault_proxy import FaultProxy
from chaos.leaks import ResultRow

from pdcluster.config import EngineArgs
from pdcluster.connectors import engine_connector_factory
from pdcluster.connectors.testing import PREFILL_LEG, assert_idle, decode_leg, run_requests
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.sampling_params import SamplingParams
from pdcluster.transfer.protocol import RESP_HEADER

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "connectors"))
from p2p_procs import ClusterKeys  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
IO_TIMEOUT_S = 2.0  # a blackholed pull fails after this (P2P option io_timeout_s)


def _engine(model: str, role: str | None, options: dict[str, Any] | None = None) -> LLMEngine:
    args = EngineArgs(model=model, num_kv_blocks=96, max_model_len=256, block_size=16,
                      enable_prefix_caching=role is not None, kv_connector="p2p" if role else None,
                      kv_role=role or "both", kv_connector_options=options)
    return LLMEngine.from_engine_args(args, connector=engine_connector_factory if role else None)


def _worker(engine: LLMEngine) -> Any:
    return engine.core.runner.connector_hooks.connector._worker


@pytest.fixture(scope="module")
def plane(demo_model: str) -> Iterator[tuple[dict[str, LLMEngine], FaultProxy]]:
    keys = ClusterKeys()
    consumer = dict(transport="tcp", io_timeout_s=IO_TIMEOUT_S, connect_timeout_s=IO_TIMEOUT_S)
    made: dict[str, LLMEngine] = {}
    proxy = None
    try:
        made["ref"] = _engine(demo_model, None)
        made["producer"] = _engine(demo_model, "producer", keys.options("producer", engine_id="chaos-producer",
                                                                        lease_ttl_s=20.0))
        made["recompute"] = _engine(demo_model, "consumer", keys.options(
            "consumer", engine_id="chaos-recompute", failure_policy="recompute", **consumer))
        made["fail"] = _engine(demo_model, "consumer", keys.options("consumer", engine_id="chaos-fail", **consumer))
        agent = _worker(made["producer"]).agent
        proxy = FaultProxy(agent.server.address)
        real_body = agent.body
        agent.body = lambda: {**real_body(), "data_port": proxy.address[1]}  # consumers pull via the proxy
        yield made, proxy
    finally:
        if proxy is not None:
            proxy.close()
        for e in made.values():
            e.shutdown()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(50)]


FAULTS: dict[str, Callable[[FaultProxy], None]] = {
    "reset (RST)": lambda p: p.reset(),
    "blackhole": lambda p: p.blackhole(),
    "corrupt producer->consumer": lambda p: p.corrupt("down", RESP_HEADER.size + 777),
    "truncate producer->consumer": lambda p: p.truncate("down", RESP_HEADER.size + 100),
    "delay 50 ms/chunk": lambda p: p.delay(50),
    "bandwidth 1 MB/s": lambda p: p.bandwidth(1_000_000),
}
DEGRADED = ("delay 50 ms/chunk", "bandwidth 1 MB/s")  # slow, not broken: the pull must succeed


def _case(plane: Any, chaos_rows: list[ResultRow], name: str, policy: str, seed: int) -> None:
    made, proxy = plane
    prompt = _prompt(seed)
    rid = f"chaos-{policy}-{seed}"
    want = run_requests(made["ref"], [(f"ref-{rid}", prompt, GREEDY, None, None)], [])[f"ref-{rid}"]
    want_tokens = list(want.outputs[0].token_ids)
    loader = _worker(made[policy]).loader
    failed_before = loader.counters["loads_failed"]
    metrics_before = _connector_metrics(loader.stats())
    producer = made["producer"]
    pre = run_requests(producer, [(rid, prompt, GREEDY.replace(max_tokens=1), PREFILL_LEG, None)], [])[rid]
    FAULTS[name](proxy)
    t0 = time.monotonic()
    try:
        out = run_requests(made[policy], [(rid, prompt, GREEDY, decode_leg(pre), pre.outputs[0].token_ids)],
                           [producer])[rid]
    finally:
        proxy.clear()
    took = time.monotonic() - t0
    got = list(pre.outputs[0].token_ids) + list(out.outputs[0].token_ids)
    failed = loader.counters["loads_failed"] - failed_before
    error = out.error or ""
    if out.outputs[0].finish_reason == "error":
        end = "error" if "KV transfer failed" in error else "lost"
    else:
        end = "right" if got == want_tokens else "lost"
    leaks = []
    for engine_name in ("producer", policy):
        try:
            assert_idle(made[engine_name], [producer] if engine_name != "producer" else [], engine_name, 30)
        except AssertionError as e:
            leaks.append(str(e)[:160])
    leases = _worker(producer).agent.stats().get("p2p_leases_active", 0)
    if leases:
        leaks.append(f"producer leases {leases}")
    metrics = {k: v - metrics_before.get(k, 0.0) for k, v in _connector_metrics(loader.stats()).items()}
    shown = (f"loads_failed +{failed}, /metrics failed_blocks +{metrics.get(FAILED_BLOCKS, 0):g}, "
             f"transfer_duration count +{metrics.get(LOAD_COUNT, 0):g}; WARNING 'p2p load of request {rid} failed: "
             f"{loader.last_errors.get(rid, '-')[:60]}'" if failed else
             f"loads_failed +0, transfer_duration count +{metrics.get(LOAD_COUNT, 0):g}")
    chaos_rows.append(ResultRow(f"{name} ({policy})", "transfer plane D->P data", 1, end == "right",
                                end == "error", end == "lost", leaks, took, shown))
    assert leaks == [], leaks
    if name in DEGRADED:  # the pull's time is in the histogram
        assert metrics.get(LOAD_COUNT) == 1, metrics
    else:  # the fault shows on the worker's /metrics: the blocks that failed
        assert metrics.get(FAILED_BLOCKS, 0) >= 1 and metrics.get(LOAD_COUNT, 0) == 0, metrics
    if name in DEGRADED:
        assert end == "right" and failed == 0, (end, error)
    elif policy == "recompute":
        assert end == "right" and failed == 1, (end, error, got, want_tokens)
    else:
        assert end == "error" and failed == 1, (end, error)


FAILED_BLOCKS = 'pdcluster_connector_failed_blocks_total{op="load"}'
LOAD_COUNT = 'pdcluster_connector_transfer_duration_seconds_count{op="load"}'


def _connector_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """The loader's stats as the worker's /metrics renders them (WorkerCollector's connector part)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pdcluster.worker.metrics_collector import connector_families

    class One:
        def collect(self) -> Iterator[Any]:
            return connector_families(stats)

    registry = CollectorRegistry()
    registry.register(One())
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_smoke_reset_pull_recomputes(plane, chaos_rows):
    """Default suite: the data plane resets every connection; the decode leg recomputes."""
    _case(plane, chaos_rows, "reset (RST)", "recompute", 1)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("name", list(FAULTS))
def test_transfer_fault_matrix(plane, chaos_rows, name, policy):
    if name in DEGRADED and policy == "fail":
        pytest.skip("a slow path fails nothing: one policy is enough")
    _case(plane, chaos_rows, name, policy, 100 + list(FAULTS).index(name) * 2 + (policy == "fail"))
