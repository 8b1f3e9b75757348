"""WorkerCollector on a stand-in engine: connector counters by name, the drain gauge, role
metrics, EC names only with an EC connector, and a registry of its own per server."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.engine.engine_counters import EngineCounters
from pdcluster.worker.metrics import start_metrics_server
from pdcluster.worker.metrics_collector import EC_ERRORS, EC_MM_ITEMS, EC_TRANSFER_BYTES, WorkerCollector
from pdcluster.worker.role_registry import AGGREGATED, WorkerRole

P2P_STATS = {"p2p_bytes_tcp": 4096, "p2p_bytes_shm": 0, "p2p_bytes_served": 8192, "p2p_loads_ok": 2,
             "p2p_loads_failed": 1, "p2p_leases_expired": 3, "p2p_leases_active": 1,
             "p2p_refused_lease_unknown": 5, "p2p_data_refused_bad_token": 1, "p2p_requests_open": 4,
             "p2p_side_channel_refusals": 2.0, "p2p_something_new": 9}


class FakeEngine:
    def __init__(self, stats: dict) -> None:
        self.stats = stats
        self.counters = EngineCounters()

    def get_stats(self) -> dict:
        return self.stats


def samples(collector: WorkerCollector) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_connector_counters_are_exported_by_name() -> None:
    role = WorkerRole("decode", "pdcluster.worker.roles:AggregatedRole", kv_role="consumer",
                      metrics=("num_running", "num_waiting_for_remote_kv", "kv_connector"))
    engine = FakeEngine({"num_running": 2, "num_waiting_for_remote_kv": 1, "kv_connector": P2P_STATS})
    got = samples(WorkerCollector(engine, role, worker_id="d0", connector="p2p"))
    assert got[("pdcluster_connector_loaded_bytes_total", (("transport", "tcp"),))] == 4096
    assert got[("pdcluster_connector_served_bytes_total", ())] == 8192
    assert got[("pdcluster_connector_loads_total", (("result", "failed"),))] == 1
    assert got[("pdcluster_connector_leases_total", (("state", "expired"),))] == 3
    assert got[("pdcluster_connector_active_leases", ())] == 1
    assert got[("pdcluster_connector_refusals_total", (("reason", "lease_unknown"),))] == 5
    assert got[("pdcluster_connector_refusals_total", (("reason", "data_refused_bad_token"),))] == 1
    assert got[("pdcluster_connector_side_channel_requests_total", (("kind", "open"),))] == 4
    assert got[("pdcluster_zmq_handshake_refusals_total", (("reason", "any"), ("socket", "p2p-side-channel")))] == 2
    assert got[("pdcluster_connector_stat_value", (("name", "p2p_something_new"),))] == 9
    assert got[("pdcluster_role_running_requests", (("role", "decode"),))] == 2
    assert got[("pdcluster_role_waiting_for_remote_kv_requests", (("role", "decode"),))] == 1
    assert not any(name.startswith(("pdcluster_mm_", "pdcluster_ec_")) for name, _ in got)


def test_draining_gauge_follows_the_request_table() -> None:
    table = SimpleNamespace(draining=False)
    collector = WorkerCollector(FakeEngine({}), AGGREGATED, worker_id="w", connector=None, requests=table)
    assert samples(collector)[("pdcluster_worker_draining", ())] == 0
    table.draining = True
    assert samples(collector)[("pdcluster_worker_draining", ())] == 1


def test_ec_names_only_with_an_ec_connector() -> None:
    ec = {"mm_items_computed": 3, "mm_items_remote": 2, "transfer_bytes": 1000, "errors_timeout": 1}
    got = samples(WorkerCollector(FakeEngine({"ec_connector": ec}), AGGREGATED, worker_id="w", connector=None))
    assert got[(EC_MM_ITEMS, (("source", "computed"),))] == 3
    assert got[(EC_MM_ITEMS, (("source", "local_cache"),))] == 0
    assert got[(EC_MM_ITEMS, (("source", "remote"),))] == 2
    assert got[(EC_TRANSFER_BYTES, ())] == 1000
    assert got[(EC_ERRORS, (("reason", "timeout"),))] == 1


def test_step_histogram_is_cumulative() -> None:
    engine = FakeEngine({})
    for seconds in (0.0005, 0.003, 0.003, 20.0):
        engine.counters.observe_step(seconds)
    got = samples(WorkerCollector(engine, AGGREGATED, worker_id="w", connector=None))
    bucket = "pdcluster_engine_step_duration_seconds_bucket"
    assert got[(bucket, (("le", "0.001"),))] == 1
    assert got[(bucket, (("le", "0.005"),))] == 3
    assert got[(bucket, (("le", "10.0"),))] == 3
    assert got[(bucket, (("le", "+Inf"),))] == 4
    assert got[("pdcluster_engine_step_duration_seconds_count", ())] == 4
    assert got[("pdcluster_engine_step_duration_seconds_sum", ())] == pytest.approx(20.0065)


def test_servers_have_registries_of_their_own() -> None:
    servers = [start_metrics_server(WorkerCollector(FakeEngine({}), AGGREGATED, worker_id=f"w{i}", connector=None))
               for i in range(2)]
    try:
        assert servers[0].port != servers[1].port and servers[0].registry is not servers[1].registry
        for i, server in enumerate(servers):
            assert server.url == f"http://127.0.0.1:{server.port}/metrics"
            with urllib.request.urlopen(server.url, timeout=10) as resp:
                assert f'worker_id="w{i}"' in resp.read().decode()
        assert not any(m.name.startswith("pdcluster_worker") for m in REGISTRY.collect())
    finally:
        for server in servers:
            server.stop()


def test_a_taken_port_is_a_clear_error() -> None:
    first = start_metrics_server(WorkerCollector(FakeEngine({}), AGGREGATED, worker_id="w", connector=None))
    try:
        with pytest.raises(OSError, match="could not bind the metrics endpoint"):
            start_metrics_server(WorkerCollector(FakeEngine({}), AGGREGATED, worker_id="w", connector=None),
                                 port=first.port)
    finally:
        first.stop()


def test_connector_fault_counters_and_transfer_time() -> None:
    """P2P failed blocks, NOT_READY open retries and the pull-time histogram (connectors/p2p/load_times.py)."""
    from pdcluster.connectors.p2p.load_times import LoadTimes

    times = LoadTimes()
    for s in (0.0005, 0.02, 0.02, 40.0):
        times.observe(s)
    role = WorkerRole("decode", "pdcluster.worker.roles:AggregatedRole", kv_role="consumer", metrics=())
    stats = {"p2p_failed_blocks": 7, "p2p_open_retries": 3, "p2p_load_seconds": times.snapshot()}
    got = samples(WorkerCollector(FakeEngine({"kv_connector": stats}), role, worker_id="d0", connector="p2p"))
    assert got[("pdcluster_connector_failed_blocks_total", (("op", "load"),))] == 7
    assert got[("pdcluster_connector_not_ready_retries_total", ())] == 3
    name = "pdcluster_connector_transfer_duration_seconds"
    assert got[(f"{name}_count", (("op", "load"),))] == 4
    assert got[(f"{name}_sum", (("op", "load"),))] == pytest.approx(40.0405)
    assert got[(f"{name}_bucket", (("le", "0.001"), ("op", "load")))] == 1
    assert got[(f"{name}_bucket", (("le", "0.025"), ("op", "load")))] == 3
    assert got[(f"{name}_bucket", (("le", "30.0"), ("op", "load")))] == 3
    assert got[(f"{name}_bucket", (("le", "+Inf"), ("op", "load")))] == 4


def test_store_load_time_shares_the_transfer_histogram() -> None:
    """The store connector's worker side times its loads like P2P pulls (store_load_seconds)."""
    from pdcluster.connectors.p2p.load_times import LoadTimes

    times = LoadTimes()
    times.observe(0.003)
    role = WorkerRole("decode", "pdcluster.worker.roles:AggregatedRole", kv_role="consumer", metrics=())
    stats = {"store_load_blocks": 4, "store_load_seconds": times.snapshot()}
    got = samples(WorkerCollector(FakeEngine({"kv_connector": stats}), role, worker_id="d0", connector="store"))
    name = "pdcluster_connector_transfer_duration_seconds"
    assert got[(f"{name}_count", (("op", "load"),))] == 1
    assert got[(f"{name}_bucket", (("le", "0.0025"), ("op", "load")))] == 0
    assert got[(f"{name}_bucket", (("le", "0.005"), ("op", "load")))] == 1


def test_requests_ended_by_a_failed_caller_follow_the_request_table() -> None:
    """pdcluster_worker_requests_ended_total{reason}: legs ended at their deadline, or under a lost stream."""
    from pdcluster.worker.request_table import END_REASONS

    table = SimpleNamespace(draining=False, ended=dict.fromkeys(END_REASONS, 0))
    collector = WorkerCollector(FakeEngine({}), AGGREGATED, worker_id="w", connector=None, requests=table)
    name = "pdcluster_worker_requests_ended_total"
    assert {r: samples(collector)[(name, (("reason", r),))] for r in END_REASONS} == {"deadline": 0, "stream_lost": 0}
    table.ended["deadline"] += 2
    table.ended["stream_lost"] += 1
    got = samples(collector)
    assert got[(name, (("reason", "deadline"),))] == 2 and got[(name, (("reason", "stream_lost"),))] == 1
