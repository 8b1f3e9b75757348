"""A worker's Prometheus endpoint, scraped from a real `pdcluster serve-worker` process: its URL
is in the ready line, it binds loopback only, the token counters move by exactly a request's
tokens, and a refused CURVE client shows as a refusal."""

from __future__ import annotations

import time
import urllib.request

import zmq
from proc_sockets import listening
from prometheus_client.parser import text_string_to_metric_families

from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.security.curve import make_client_socket
from pdcluster.security.keys import load_keypair


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_ready_line_names_a_loopback_metrics_endpoint(worker) -> None:
    url = worker.ready["metrics"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    bound = [addr for (addr, p) in listening([worker.proc.pid]) if p == port]
    assert bound == ["127.0.0.1"], f"metrics port {port} bound on {bound}"
    samples = scrape(url)
    assert value(samples, "pdcluster_worker_info", worker_id="w-test", role="both", connector="") == 1
    assert value(samples, "pdcluster_worker_draining") == 0
    assert value(samples, "pdcluster_engine_kv_cache_total_blocks") > 0


def test_token_counters_move_by_exactly_the_request(worker, stub) -> None:
    url = worker.ready["metrics"]
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    before = scrape(url)
    req = worker_pb2.WorkerGenerateRequest(
        prompt_token_ids=prompt, stream=True,
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    out = list(stub.Generate(req, timeout=60))
    assert out[-1].finished
    num_generated = sum(len(r.token_ids) for r in out)
    assert num_generated == 7
    after = scrape(url)  # counted before the response was sent: no waiting
    for name, expected in (("pdcluster_engine_prompt_tokens_total", len(prompt)),
                           ("pdcluster_engine_generation_tokens_total", num_generated)):
        assert value(after, name) - value(before, name) == expected, name
    steps = "pdcluster_engine_step_duration_seconds_count"
    assert value(after, steps) > value(before, steps)
    assert value(after, "pdcluster_engine_step_duration_seconds_bucket", le="+Inf") == value(after, steps)
    queried = "pdcluster_engine_prefix_cache_queried_tokens_total"
    assert value(after, queried) - value(before, queried) >= len(prompt)


def test_curve_refusal_is_counted(worker, key_dir) -> None:
    """A subscriber whose key is not on the KV-event allow-list is refused, and counted."""
    url = worker.ready["metrics"]
    name = "pdcluster_zmq_handshake_refusals_total"

    def refusals() -> float:
        return sum(v for (n, _), v in scrape(url).items() if n == name)

    before = refusals()
    ctx = zmq.Context()
    sock = make_client_socket(ctx, zmq.SUB, load_keypair(key_dir, "client"), worker.ready["kv_events_public_key"],
                              worker.ready["kv_events_endpoint"])
    try:
        deadline = time.monotonic() + 60  # the handshake happens in the background
        while refusals() <= before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert refusals() > before
    finally:
        sock.close(linger=0)
        ctx.term()


def test_explicit_port_and_drain_gauge(demo_model, tmp_path) -> None:
    """--metrics-port N serves on N; the Drain RPC turns pdcluster_worker_draining to 1."""
    import socket

    import grpc
    from workers.worker_process import start_worker

    from pdcluster._proto import worker_pb2_grpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wp = start_worker(["--role", "both", "--model", demo_model, "--max-model-len", "256", "--metrics-port", str(port)],
                      tmp_path)
    try:
        assert wp.ready["metrics"] == f"http://127.0.0.1:{port}/metrics"
        assert value(scrape(wp.ready["metrics"]), "pdcluster_worker_draining") == 0
        with grpc.insecure_channel(wp.address) as ch:
            worker_pb2_grpc.WorkerStub(ch).Drain(worker_pb2.DrainRequest(timeout_s=1.0), timeout=30)
        assert value(scrape(wp.ready["metrics"]), "pdcluster_worker_draining") == 1
    finally:
        wp.stop()
