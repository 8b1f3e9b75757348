"""Refused TLS handshakes are counted and named (issue 16, item 1): a real grpc.aio server with
our dynamic credentials and HandshakeAudit on 127.0.0.1. A plaintext peer, a certificate of
another CA and garbage bytes are refused by gRPC core; the audit counts each from the
fetcher call + /proc/net/tcp and names the peer (a peer that resets the connection before any
table read is still counted, as "unseen"); a good client counts as authenticated."""

from __future__ import annotations

import asyncio
import socket
import struct

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from pdcluster.security.pki import init_pki
from pdcluster.security.rotation import dynamic_server_credentials
from pdcluster.security.tls_audit import HandshakeAudit, parse_grpc_peer
from pdcluster.worker.tls import TLSConfig, channel_credentials


def test_parse_grpc_peer() -> None:
    assert parse_grpc_peer("ipv4:127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert parse_grpc_peer("ipv6:[::1]:7") == ("::1", 7)
    assert parse_grpc_peer("ipv6:[::ffff:10.0.0.1]:7") == ("10.0.0.1", 7)
    assert parse_grpc_peer("unix:/tmp/x") is None


def test_overlapping_sweeps_never_count_an_authenticated_connection_refused() -> None:
    """The audit thread and a /metrics scrape sweep at once. Sweep A reads the table while the
    connection is open and before its RPC; the RPC happens and the connection closes; sweep B
    reads it closed and settles it. A's stale read must not make it pending again (the next
    sweep would then count it refused): sweeps run one at a time."""
    import threading

    peer = ("127.0.0.1", 40000)
    a_reading, release_a = threading.Event(), threading.Event()
    reads = iter([
        lambda: (a_reading.set(), release_a.wait(30), {peer: True})[-1],  # A: open, before the RPC
        lambda: {peer: False},                                           # B: closed (TIME_WAIT)
        lambda: {},                                                      # later: the row is gone
    ])
    audit = HandshakeAudit("worker", connections=lambda port: next(reads)())
    audit.port = 1  # no background thread: this test runs the sweeps itself
    audit.on_handshake()
    a = threading.Thread(target=audit.sweep)
    a.start()
    assert a_reading.wait(30)
    audit.on_rpc("ipv4:127.0.0.1:40000")
    b = threading.Thread(target=audit.sweep)
    b.start()
    b.join(0.5)  # without one-at-a-time sweeps B is done by now; with it B waits for A
    release_a.set()
    a.join(30)
    b.join(30)
    audit.sweep()
    assert dict(audit.counts) == {"started": 1, "authenticated": 1}


def test_refused_handshakes_counted_with_peer(tmp_path) -> None:
    ca = init_pki(tmp_path / "pki")
    w, r = ca.issue("worker", "w0"), ca.issue("router", "router")
    other = init_pki(tmp_path / "other").issue("router", "router")

    async def run() -> None:
        audit = HandshakeAudit("worker")
        server = grpc.aio.server(interceptors=[audit.interceptor()])
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        creds = dynamic_server_credentials(w.cert, w.key, w.ca, on_handshake=audit.on_handshake)[0]
        port = server.add_secure_port("127.0.0.1:0", creds)
        audit.start(port)
        await server.start()
        addr = f"127.0.0.1:{port}"

        # One connection attempt per check: a refused channel would otherwise reconnect after its
        # ~1 s backoff if closing it is slow (a loaded CI box), and that second refusal is counted.
        once = [("grpc.initial_reconnect_backoff_ms", 600_000), ("grpc.min_reconnect_backoff_ms", 600_000),
                ("grpc.max_reconnect_backoff_ms", 600_000), ("grpc.enable_retries", 0)]

        async def check(creds) -> bool:
            ch = (grpc.aio.secure_channel(addr, creds, options=once) if creds
                  else grpc.aio.insecure_channel(addr, options=once))
            try:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                return True
            except grpc.aio.AioRpcError:
                return False
            finally:
                await ch.close()

        async def settled(n: int) -> None:  # bounds a hang only; ends when the count is reached
            for _ in range(1200):
                audit.sweep()
                if audit.counts["refused"] >= n:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"refusals not settled: {dict(audit.counts)}")

        try:
            good = channel_credentials(TLSConfig(ca=r.ca, cert=r.cert, key=r.key))
            assert await check(good)
            assert audit.counts["authenticated"] == 1 and audit.counts["refused"] == 0
            assert not await check(None)  # plaintext
            await settled(1)
            foreign = channel_credentials(TLSConfig(ca=w.ca, cert=other.cert, key=other.key))
            assert not await check(foreign)
            await settled(2)
            s = socket.create_connection(("127.0.0.1", port))  # garbage: the server hangs up
            s.sendall(b"\x00garbage\r\n" * 10)
            assert await asyncio.get_running_loop().run_in_executor(None, s.recv, 100) == b""
            s.close()
            await settled(3)
            for _ in range(5):  # reset at once (RST: no TIME_WAIT row), likely before any table read
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(b"\x16\x03\x01garbage")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            await settled(8)  # counted from the fetcher's starts, named where a read saw them
            assert await check(good)  # the server still serves
            reg = CollectorRegistry()
            reg.register(audit)
            assert reg.get_sample_value("pdcluster_tls_handshakes_total",
                                        {"server": "worker", "result": "refused"}) == 8
            named = reg.get_sample_value("pdcluster_tls_refused_peers_total", {"server": "worker", "peer": "127.0.0.1"})
            unseen = reg.get_sample_value("pdcluster_tls_refused_peers_total",
                                          {"server": "worker", "peer": "unseen"}) or 0
            # The garbage peer is always named: the server hung up first (its TIME_WAIT row stays).
            assert named >= 1 and named + unseen == 8
            assert audit.counts["started"] == 10 and audit.counts["authenticated"] == 2
        finally:
            await server.stop(None)
            audit.stop()

    asyncio.run(run())


def _metric(text: str, sample: str) -> float:
    """The value of one sample line of a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def test_kvstore_master_counts_refused_handshakes(tmp_path, caplog) -> None:
    import argparse
    import time
    import urllib.request

    from pdcluster.kvstore.master import add_master_args, build_master
    from pdcluster.kvstore.rpc import make_channel

    ca = init_pki(tmp_path / "pki")
    m, node = ca.issue("kvstore-master", "master"), ca.issue("kvstore-node", "n0")
    p = argparse.ArgumentParser()
    add_master_args(p)
    args = p.parse_args(["--port", "0", "--metrics-port", "0", "--secret-file", str(tmp_path / "secret"),
                         "--tls-cert", m.cert, "--tls-key", m.key, "--tls-client-ca", m.ca])
    master = build_master(args).start()
    try:
        # One plaintext HTTP/2 connection, as a plaintext gRPC client opens it (preface + empty
        # SETTINGS). A raw socket, not grpc.insecure_channel: that channel reconnects within its
        # deadline after the refusal, so how many refusals it causes depends on the machine's speed.
        host, port = master.address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
        ours = f"127.0.0.1:{s.getsockname()[1]} refused"
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        s.settimeout(30)
        while s.recv(100):  # the server hangs up on bytes that are not a TLS ClientHello
            pass
        s.close()
        with make_channel(master.address, tls_ca=node.ca, tls_cert=node.cert, tls_key=node.key) as ch:
            try:  # authenticated (the master serves no health service: UNIMPLEMENTED is an RPC)
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNIMPLEMENTED
        # At least ours: the master's port is an ephemeral one, and a channel an earlier test of
        # this process left reconnecting to that number may be refused here too (CI once counted
        # 4 refusals, from 4 source ports, in the same millisecond as ours).
        url = f"http://127.0.0.1:{master.metrics_port}/metrics"
        for _ in range(1200):  # bounds a hang only: ends when the refusal is settled
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            refused = _metric(text, 'pdcluster_tls_handshakes_total{result="refused",server="kvstore-master"}')
            logged = [r.getMessage() for r in caplog.records]
            if refused >= 1 and any(ours in m or "before it could be named" in m for m in logged):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(text)
        assert master.tls_audit.counts["authenticated"] >= 1
        # Named, or "unseen" when the plaintext client reset the connection before any read.
        peers = sum(_metric(text, f'pdcluster_tls_refused_peers_total{{peer="{peer}",server="kvstore-master"}}')
                    for peer in ("127.0.0.1", "unseen"))  # every refusal named by one of the two
        assert peers == refused, text
    finally:
        master.stop()
