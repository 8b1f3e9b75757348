"""Every port a local deployment opens: loopback only, and hostile or plaintext peers change nothing.

`pdcluster serve` is started as a real process tree (router, prefill and decode workers, and for
the store connector a kvstore master and node). The test finds every TCP socket that tree listens
on from /proc (it does not trust the ready line to name them all), then hits each one with:
random bytes, a plaintext HTTP request, a plaintext (NULL-mechanism) ZMQ peer, a plaintext gRPC
call to a method nobody serves, and a connection that sends half a frame and stays open. After
that every process must still run and the cluster must still answer a request with the same
tokens as before.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
from collections.abc import Iterator

import grpc
import pytest
import zmq
from proc_sockets import listening
from serve_procs import descendants, start_serve, stop_serve

from pdcluster import SamplingParams
from pdcluster.client import Client

PROMPT = list(range(5, 30))
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    from pdcluster.models.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "model")


def _hostile(port: int, rng: random.Random, ctx: zmq.Context, zmq_silent: bool) -> list[socket.socket]:
    """Throw everything at one port; returns sockets left half-open on purpose."""
    garbage = bytes(rng.getrandbits(8) for _ in range(4096))
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        try:
            s.sendall(garbage)
            s.recv(1024)
        except OSError:
            pass  # the peer hung up on us: fine
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        try:
            s.sendall(b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n")
            s.recv(1024)
        except OSError:
            pass
    z = ctx.socket(zmq.DEALER)  # a plaintext ZMQ peer: a CURVE server must never answer it
    z.setsockopt(zmq.LINGER, 0)
    z.connect(f"tcp://127.0.0.1:{port}")
    try:
        z.send_multipart([b"", b"\x93\x01\x02\x03", garbage[:512]])
        # (A plain HTTP/gRPC port may "answer": libzmq reads its reply as a legacy ZMTP 1.0 frame.)
        assert not (z.poll(300) and zmq_silent), f"port {port} answered a plaintext ZMQ peer"
    finally:
        z.close(0)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            ch.unary_unary("/pdcluster.v1.Nope/Nope")(garbage[:100], timeout=2)
            raise AssertionError(f"port {port} served an unknown gRPC method")
        except grpc.RpcError as e:
            assert e.code() != grpc.StatusCode.OK
    half = socket.create_connection(("127.0.0.1", port), timeout=2)
    half.sendall(b"\x00\x00\x10")  # the start of a length prefix, then silence
    return [half]


@pytest.fixture(params=[["--prefill", "1", "--decode", "1", "--connector", "p2p", "--policy", "prefix_aware"],
                        ["--prefill", "1", "--decode", "1", "--connector", "store"]],
                ids=["p2p-prefix_aware", "store"])
def cluster(request, demo_model: str) -> Iterator[tuple[subprocess.Popen, dict]]:
    proc, ready = start_serve(["--model", demo_model, "--worker-args", "--max-model-len 256", *request.param])
    try:
        yield proc, ready
    finally:
        stop_serve(proc)


def test_every_port_is_loopback_and_survives_hostile_peers(cluster) -> None:
    proc, ready = cluster
    with Client(ready["grpc"], timeout=120) as c:
        before = c.generate(PROMPT, PARAMS).token_ids
    assert len(before) == PARAMS.max_tokens
    pids = [proc.pid, *descendants(proc.pid)]
    ports = listening(pids)
    # Router gRPC + HTTP, two workers' gRPC, and their connector / KV-event sockets at least.
    assert len(ports) >= 6, ports
    loopback = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
    assert all(addr in loopback for addr, _ in ports), f"non-loopback listener: {ports}"
    rng = random.Random(0)
    ctx = zmq.Context()
    held: list[socket.socket] = []
    try:
        known_http2 = {int(a.rsplit(":", 1)[1]) for a in [ready["grpc"], ready["http"], *ready["workers"]]}
        for _, port in sorted(ports):
            held += _hostile(port, rng, ctx, zmq_silent=port not in known_http2)
        with Client(ready["grpc"], timeout=120) as c:  # with the half-open connections still held
            after = c.generate(PROMPT, PARAMS).token_ids
    finally:
        for s in held:
            s.close()
        ctx.destroy(linger=0)
    assert after == before
    assert all(os.path.exists(f"/proc/{pid}") for pid in pids), "a process died"
    assert proc.poll() is None
