"""Every port a local deployment opens: loopback only, and hostile or plaintext peers change nothing.

`pdcluster serve` is started as a real process tree (router, prefill and decode workers, their TP
ranks, an encode worker, and for the store connector a kvstore master and node). The test finds
every TCP socket that tree listens on from /proc (it does not trust the ready line to name them
all), then:

- every mutual-TLS port (found by a TLS probe holding a certificate of the run's own CA: the
  workers' gRPC, the kvstore master) refuses a client without a certificate and one holding a
  certificate of another CA, and the worker's (master's) /metrics counts each refusal exactly
  (pdcluster_tls_handshakes_total, started - authenticated);
- every port gets random bytes, a plaintext HTTP request, a plaintext (NULL-mechanism) ZMQ peer,
  a plaintext gRPC call to a method nobody serves, and a connection that sends half a frame and
  stays open; ZMQ CURVE ports (KV events, the P2P side channel, the EC control port) never answer
  the plaintext peer, and the EC planes count what they refused (pdcluster_ec_errors_total{reason=
  "control_handshake"|"control_*"} for the control port, reason="data_refused" for its transfer
  server);
- afterwards every process still runs and the cluster answers with the same tokens as before (for
  E/P/D: an image request equals the offline text).

The P2P and store shapes run in the default suite; TP=2 and E/P/D are `slow` (each ~30-60 s).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq
from proc_sockets import listening, non_loopback
from security.deploy_probes import closed_by_server, hostile, scrape, serve_pki, tls_probe, total, wait_for
from serve_procs import descendants, start_serve, stop_serve

from pdcluster import SamplingParams
from pdcluster.client import Client

PROMPT = list(range(5, 30))
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
HANDSHAKES = "pdcluster_tls_handshakes_total"
ZMQ_REFUSALS = "pdcluster_zmq_handshake_refusals_total"


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    from pdcluster.models.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    """A router certificate (the role the workers admit) from a CA that is not the cluster's."""
    from pdcluster.security.pki import init_pki

    return init_pki(tmp_path_factory.mktemp("other-ca")).issue("router", "router")


def _serve(args: list[str]) -> Iterator[tuple[subprocess.Popen, dict]]:
    proc, ready = start_serve(args)
    try:
        yield proc, ready
    finally:
        stop_serve(proc)


@pytest.fixture(params=[["--prefill", "1", "--decode", "1", "--connector", "p2p", "--policy", "prefix_aware"],
                        ["--prefill", "1", "--decode", "1", "--connector", "store"]],
                ids=["p2p-prefix_aware", "store"])
def cluster(request, demo_model: str) -> Iterator[tuple[subprocess.Popen, dict]]:
    yield from _serve(["--model", demo_model, "--worker-args", "--max-model-len 256", *request.param])


@pytest.fixture
def tp_cluster(demo_model: str) -> Iterator[tuple[subprocess.Popen, dict]]:
    yield from _serve(["--model", demo_model, "--worker-args", "--max-model-len 256", "--prefill", "1",
                       "--decode", "1", "--connector", "store", "--prefill-tp", "2"])


def _refused(url: str) -> tuple[float, float]:
    """(refused, started - authenticated) TLS handshakes on one /metrics page."""
    s = scrape(url)
    result = lambda r: lambda labels: labels.get("result") == r  # noqa: E731
    return total(s, HANDSHAKES, result("refused")), total(s, HANDSHAKES, result("started")) - total(
        s, HANDSHAKES, result("authenticated"))


def _tls_metrics(ports: dict, ready: dict) -> dict[int, str]:
    """gRPC port -> the /metrics URL of the process that serves it (workers, kvstore master)."""
    out = {int(i["address"].rsplit(":", 1)[1]): i["metrics"] for i in ready["instances"].values() if i["metrics"]}
    if "kvstore_master" in ready:  # serve starts it with --metrics-port 0: its other listener
        mport = int(ready["kvstore_master"].rsplit(":", 1)[1])
        mpid = next(pid for (_, p), pid in ports.items() if p == mport)
        others = [p for (_, p), pid in ports.items() if pid == mpid and p != mport]
        if others:
            out[mport] = f"http://127.0.0.1:{others[0]}/metrics"
    return out


def check_tls_ports(ports: dict, ready: dict, other_ca, pki_root: str) -> set[int]:
    """Every mutual-TLS port of the tree refuses no certificate and another CA's, counted."""
    from pdcluster.security.pki import ClusterCA

    good = ClusterCA(pki_root).issue("router", f"deploy-probe-{random.getrandbits(32):08x}")
    with ThreadPoolExecutor(8) as pool:
        states = dict(zip(sorted(p for _, p in ports),
                          pool.map(lambda p: tls_probe(p, good.cert, good.key), sorted(p for _, p in ports))))
    tls = {p for p, state in states.items() if state == "accepted"}
    internal = {int(a.rsplit(":", 1)[1]) for a in ready["workers"]}
    if "kvstore_master" in ready:
        internal.add(int(ready["kvstore_master"].rsplit(":", 1)[1]))
    assert internal <= tls, f"internal gRPC ports without mutual TLS: {sorted(internal - tls)} ({states})"
    metrics = _tls_metrics(ports, ready)
    before = {p: _refused(metrics[p])[1] for p in tls if p in metrics}  # started - authenticated
    bad = {"no certificate": (None, None), "another CA's certificate": (other_ca.cert, other_ca.key)}
    for port in sorted(tls):
        for what, (cert, key) in bad.items():
            assert tls_probe(port, cert, key) != "accepted", f"port {port} let in a TLS client with {what}"
            if port in before:
                # started - authenticated counts each refused handshake exactly (tls_audit.py).
                # The named `refused` / refused_peers counts are not asserted: the audit thread
                # misses some (counted in started only); see notes/deploy.md.
                url, exact = metrics[port], before[port]
                assert _refused(url)[1] >= exact + 1, f"{what} on port {port}: refusal not counted on {url}"
                before[port] = _refused(url)[1]
    assert set(before) >= internal, f"a TLS port with no refusal counter: {sorted(internal - set(before))}"
    return tls


def probe_tree(proc: subprocess.Popen, ready: dict, other_ca, zmq_speakers: set[int] = frozenset()) -> list[int]:
    """Loopback only, TLS checks, hostile peers on every port; returns the pids it checked."""
    pids = [proc.pid, *descendants(proc.pid)]
    ports = listening(pids)
    assert non_loopback(pids) == [], "non-loopback listener"
    first_worker = next(iter(ready["instances"].values()))["pid"]
    tls = check_tls_ports(ports, ready, other_ca, serve_pki(first_worker))
    metrics = {name: i["metrics"] for name, i in ready["instances"].items() if i["metrics"]}
    zmq_refused = {name: total(scrape(url), ZMQ_REFUSALS) for name, url in metrics.items()}
    rng = random.Random(0)
    ctx = zmq.Context()
    held: list[socket.socket] = []
    http = {int(a.rsplit(":", 1)[1]) for a in [ready["grpc"], ready["http"]]} | tls
    http |= {int(i["metrics"].rsplit(":", 1)[1].split("/")[0]) for i in ready["instances"].values() if i["metrics"]}
    ready["sealed"] = []
    try:
        for _, port in sorted(ports):
            got = hostile(port, rng, ctx, zmq_silent=port not in http and port not in zmq_speakers)
            if got is None:
                ready["sealed"].append(port)
            else:
                held += got
        with Client(ready["grpc"], timeout=120) as c:  # with the half-open connections still held
            ready["after"] = c.generate(PROMPT, PARAMS).token_ids
    finally:
        for s in held:
            s.close()
        ctx.destroy(linger=0)
    assert all(os.path.exists(f"/proc/{pid}") for pid in pids), "a process died"
    assert proc.poll() is None
    for name, url in metrics.items():  # each worker's KV-event CURVE sockets refused the plaintext peer
        assert wait_for(lambda url=url: total(scrape(url), ZMQ_REFUSALS), zmq_refused[name] + 1) > zmq_refused[name], \
            f"{name}: plaintext ZMQ peers not counted"
    return pids


def _before(ready: dict) -> list[int]:
    with Client(ready["grpc"], timeout=120) as c:
        before = c.generate(PROMPT, PARAMS).token_ids
    assert len(before) == PARAMS.max_tokens
    return before


def test_every_port_is_loopback_and_survives_hostile_peers(cluster, other_ca) -> None:
    proc, ready = cluster
    before = _before(ready)
    assert len(listening([proc.pid, *descendants(proc.pid)])) >= 6  # router x2, workers' gRPC + connector sockets
    grpc_ports = [ready["grpc"], *ready["workers"], *([ready["kvstore_master"]] if "kvstore_master" in ready else [])]
    idle = [socket.create_connection(("127.0.0.1", int(a.rsplit(":", 1)[1])), timeout=5) for a in grpc_ports]
    # grpc_limits.py closes them at 10 s; grpc's own default is 120 s. The bound counts from the
    # opening, so a slow probe below cannot make the check fail (only pass without meaning).
    closed_by = time.monotonic() + 90.0
    try:
        probe_tree(proc, ready, other_ca)
        assert ready["after"] == before
        assert ready["sealed"] == []  # only a TP group's gloo listeners take no connection
        for address, s in zip(grpc_ports, idle):  # never finished a handshake: closed
            assert closed_by_server(s, closed_by), f"{address} kept a silent connection open past its handshake timeout"
    finally:
        for s in idle:
            s.close()


@pytest.mark.slow
def test_tp2_store_every_rank_port_loopback_and_survives(tp_cluster, other_ca) -> None:
    proc, ready = tp_cluster
    before = _before(ready)
    pids = [proc.pid, *descendants(proc.pid)]
    ranks = [pid for pid in pids if b"rank_main" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert ranks, "the prefill worker has no child rank"
    assert listening(ranks), "the child rank listens on nothing (gloo pairs expected)"
    probe_tree(proc, ready, other_ca)
    assert ready["after"] == before
    # Two gloo groups (model, control) per rank, each listener sealed once the mesh is connected.
    assert len(ready["sealed"]) == 2 * 2, ready["sealed"]



@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    from security.llava_serve import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("llava") / "ckpt"))


@pytest.fixture
def epd_cluster(llava: str) -> Iterator[tuple[subprocess.Popen, dict]]:
    from security.llava_serve import WORKER_ARGS

    yield from _serve(["--model", llava, "--encode", "1", "--prefill", "1", "--decode", "1", "--connector", "p2p",
                       "--policy", "round_robin", "--worker-args", WORKER_ARGS])


@pytest.mark.slow
def test_epd_ec_ports_refuse_plaintext_and_garbage_and_count_it(epd_cluster, llava: str, other_ca) -> None:
    from models.llava_tiny import random_image
    from security.llava_serve import chat, offline_text

    proc, ready = epd_cluster
    before = _before(ready)
    assert chat(ready, random_image(21))  # the EC path works before the probes
    with Client(ready["grpc"], timeout=60) as c:
        ec_ports = {e.worker_id: int(e.ec_endpoint.rsplit(":", 1)[1]) for e in c.list_workers() if e.ec_endpoint}
    assert {"encode-0", "prefill-0"} <= set(ec_ports), ec_ports  # producers: an EC control port each
    listeners = listening([proc.pid, *descendants(proc.pid)])
    assert all(("127.0.0.1", p) in listeners for p in ec_ports.values()), (ec_ports, listeners)

    def remote() -> float:
        return total(scrape(ready["instances"]["prefill-0"]["metrics"]), "pdcluster_mm_items_total",
                     lambda labels: labels.get("source") == "remote")

    def control_refusals(name: str) -> float:
        return total(scrape(ready["instances"][name]["metrics"]), "pdcluster_ec_errors_total",
                     lambda labels: labels.get("reason", "").startswith("control_"))

    def data_refusals(name: str) -> float:
        return total(scrape(ready["instances"][name]["metrics"]), "pdcluster_ec_errors_total",
                     lambda labels: labels.get("reason") == "data_refused")

    fetched = wait_for(remote, 1)
    assert fetched >= 1  # prefill-0 fetched the encoder's output
    refused = {name: control_refusals(name) for name in ec_ports}
    data_refused = {name: data_refusals(name) for name in ec_ports}
    probe_tree(proc, ready, other_ca)
    assert ready["after"] == before
    image = random_image(22)  # a new image: the encoder encodes it, P fetches it over the EC planes
    assert chat(ready, image) == offline_text(llava, image)

    for name in ec_ports:  # the plaintext ZMQ peer and the garbage on its control port, counted
        assert wait_for(lambda name=name: control_refusals(name), refused[name] + 1) >= refused[name] + 1, \
            f"{name}: EC control refusals not counted"
        assert wait_for(lambda name=name: data_refusals(name), data_refused[name] + 1) >= data_refused[name] + 1, \
            f"{name}: garbage on the EC data plane not counted"
    assert wait_for(remote, fetched + 1) >= fetched + 1  # the EC data plane still serves after the garbage
