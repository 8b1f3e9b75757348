"""A storage node's /metrics (kvstore/metrics.py NodeCollector), scraped from a real node process.

A real master and node on 127.0.0.1; the client runs here with the TCP data plane (use_shm=False:
same-host shared-memory copies never reach the node, so only TCP traffic is the node's to count).
Counters are asserted as differences, by exactly what the puts and gets moved."""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Callable

import numpy as np
from proc_sockets import listening, non_loopback
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.kvstore import KVStoreClient, Status
from pdcluster.transfer import OP_READ, TransferClient, TransferError, issue_token

N = "pdcluster_kvstore_node_"
SIZE = 8 << 10  # one data-plane request per object (below the client's stream split)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((N + name, tuple(sorted(labels.items()))), 0.0)


def wait_until(check: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Heartbeats run on the node's own thread: poll, with a deadline far above any beat."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def start_node(procs, master: str, node_id: str) -> tuple[int, dict]:
    proc, ready = procs.spawn("pdcluster.kvstore.node", "--master", master, "--node-id", node_id, "--size", "8M",
                              "--heartbeat-s", "0.2", "--metrics-port", "0")
    assert isinstance(ready["metrics_port"], int) and ready["metrics_port"] > 0
    return proc.pid, ready


def test_node_metrics_count_puts_gets_bytes_and_refusals(procs) -> None:
    mproc, master = procs.master("--port", "0")
    pid, ready = start_node(procs, master, "metrics-node")
    port = ready["metrics_port"]
    assert non_loopback([pid]) == [] and ("127.0.0.1", port) in listening([pid])

    s0 = scrape(port)
    assert value(s0, "segments") == 1 and value(s0, "capacity_bytes") == 8 << 20
    assert value(s0, "master_reachable") == 1
    assert wait_until(lambda: value(scrape(port), "objects") == 0 and value(scrape(port), "used_bytes") == 0)

    puts, gets = 5, 3
    data = [np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8) for i in range(puts)]
    with KVStoreClient(master, use_shm=False) as client:
        for i, d in enumerate(data):
            assert client.put(f"m/{i}", d) == Status.OK
        for i in range(gets):
            out = bytearray(SIZE)
            assert client.get(f"m/{i}", out) == SIZE and bytes(out) == data[i].tobytes()
    s1 = scrape(port)
    assert value(s1, "requests_total", op="write") - value(s0, "requests_total", op="write") == puts
    assert value(s1, "requests_total", op="read") - value(s0, "requests_total", op="read") == gets
    assert value(s1, "written_bytes_total") - value(s0, "written_bytes_total") == puts * SIZE
    assert value(s1, "read_bytes_total") - value(s0, "read_bytes_total") == gets * SIZE
    assert value(s1, "requests_ok_total") - value(s0, "requests_ok_total") == puts + gets
    # What the node holds, as the master reports it in each heartbeat reply.
    assert wait_until(lambda: value(scrape(port), "objects") == puts)
    s = scrape(port)
    assert value(s, "object_bytes") == puts * SIZE and value(s, "used_bytes") >= puts * SIZE
    with KVStoreClient(master, use_shm=False) as client:
        assert client.remove("m/0")
    assert wait_until(lambda: value(scrape(port), "objects") == puts - 1)
    assert value(scrape(port), "object_bytes") == (puts - 1) * SIZE
    # A same-host client writes through shared memory: no data-plane request, still an object here.
    with KVStoreClient(master) as shm_client:
        assert shm_client.put("m/shm", data[0]) == Status.OK
    assert wait_until(lambda: value(scrape(port), "objects") == puts)
    s1 = scrape(port)
    assert value(s1, "requests_total", op="write") - value(s0, "requests_total", op="write") == puts

    # A caller whose token was not minted under this node's key: refused, counted as bad_mac,
    # and nothing of it is counted as served.
    host, dport = ready["data_address"].rsplit(":", 1)
    forged = issue_token(os.urandom(32), os.urandom(16), OP_READ, 1, [(0, SIZE)], ttl_s=30)
    tc = TransferClient(num_streams=1)
    try:
        tc.read((host, int(dport)), forged, [(0, SIZE)], bytearray(SIZE))
        raise AssertionError("a forged token was served")
    except TransferError:
        pass
    finally:
        tc.close()
    s2 = scrape(port)
    assert value(s2, "refused_total", reason="bad_mac") - value(s1, "refused_total", reason="bad_mac") == 1
    assert value(s2, "requests_total", op="read") == value(s1, "requests_total", op="read")
    assert value(s2, "read_bytes_total") == value(s1, "read_bytes_total")

    # Heartbeats: answered while the master runs; counted as failures once it is gone.
    assert wait_until(lambda: value(scrape(port), "heartbeats_total") > value(s2, "heartbeats_total"))
    assert value(scrape(port), "heartbeat_failures_total") == 0
    procs.kill(mproc)
    assert wait_until(lambda: value(scrape(port), "heartbeat_failures_total") >= 1)
    assert wait_until(lambda: value(scrape(port), "master_reachable") == 0)


def test_node_without_metrics_port_opens_no_metrics_listener(procs) -> None:
    _, master = procs.master("--port", "0")
    proc, ready = procs.spawn("pdcluster.kvstore.node", "--master", master, "--node-id", "quiet", "--size", "8M")
    assert ready["metrics_port"] is None
    dport = int(ready["data_address"].rsplit(":", 1)[1])
    assert [p for (_, p) in listening([proc.pid])] == [dport]
