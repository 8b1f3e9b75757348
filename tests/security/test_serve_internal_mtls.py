"""`pdcluster serve` runs router <-> worker gRPC over mutual TLS by default (issue 16, item 1):
with no certificates given it makes a CA for the run and hands every worker only its own
identity. A plaintext client and a router certificate from another CA are refused by every
worker; the router still serves requests."""

from __future__ import annotations

import os

import grpc
import pytest
from security.deploy_probes import wait_refusals
from serve_procs import descendants, start_serve, stop_serve

from pdcluster import SamplingParams
from pdcluster.client import Client
from pdcluster.security.pki import init_pki
from pdcluster.worker.tls import TLSConfig, channel_credentials


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    from pdcluster.models.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "model")


def _health(addr: str, creds: grpc.ChannelCredentials | None) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with (grpc.secure_channel(addr, creds) if creds else grpc.insecure_channel(addr)) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


def test_workers_take_only_the_runs_router(demo_model: str, tmp_path) -> None:
    proc, ready = start_serve(["--model", demo_model, "--prefill", "1", "--decode", "1", "--connector", "p2p"])
    try:
        workers = ready["workers"]
        assert len(workers) == 2
        foreign = init_pki(tmp_path / "other").issue("router", "router")
        foreign_creds = channel_credentials(TLSConfig(ca=foreign.ca, cert=foreign.cert, key=foreign.key))
        for addr in workers:
            for creds in (None, foreign_creds):
                with pytest.raises(grpc.RpcError) as e:
                    _health(addr, creds)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with Client(ready["grpc"], timeout=120) as client:
            out = client.generate(list(range(5, 20)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            assert len(out.token_ids) == 4
        # The refusals are counted and named on each worker's /metrics (security/tls_audit.py).
        # gRPC's channel may try a refused handshake again before the probe closes it (its ~1 s
        # reconnect backoff against however long the close takes): at least two, each one named.
        for inst in ready["instances"].values():  # named 127.0.0.1, or "unseen" (reset before the read)
            refused, named, unseen = wait_refusals(inst["metrics"], "worker", 2)
            assert refused >= 2 and named + unseen == refused
        # Each worker got its own identity (by path), and no other instance's key.
        keys = {}
        for pid in descendants(proc.pid):
            argv = _cmdline(pid)
            if "--tls-key" in argv and "--worker-id" in argv:
                name = argv[argv.index("--worker-id") + 1]
                key = argv[argv.index("--tls-key") + 1]
                assert f"/{name}/" in key and os.stat(key).st_mode & 0o777 == 0o600
                assert argv[argv.index("--key-name") + 1] == name  # its own CURVE pair too
                keys[name] = key
        assert sorted(keys) == ["decode-0", "prefill-0"]
    finally:
        stop_serve(proc)


def test_the_store_plane_is_mutual_tls_too(demo_model: str, tmp_path) -> None:
    from pdcluster._proto import kvstore_pb2 as pb
    from pdcluster._proto import kvstore_pb2_grpc as pb_grpc

    proc, ready = start_serve(["--model", demo_model, "--prefill", "1", "--decode", "1", "--connector", "store",
                               "--kvstore-node-size", "64M"])
    try:
        master = ready["kvstore_master"]
        foreign = init_pki(tmp_path / "other").issue("worker", "prefill-0")
        with grpc.insecure_channel(master) as ch, pytest.raises(grpc.RpcError) as e:
            pb_grpc.KVStoreMasterStub(ch).Exists(pb.KVExistsRequest(key="k"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        creds = channel_credentials(TLSConfig(ca=foreign.ca, cert=foreign.cert, key=foreign.key))
        with grpc.secure_channel(master, creds) as ch, pytest.raises(grpc.RpcError) as e:
            pb_grpc.KVStoreMasterStub(ch).Exists(pb.KVExistsRequest(key="k"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        prompt = list(range(5, 60))
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        with Client(ready["grpc"], timeout=120) as client:  # workers put and get over mTLS
            first = client.generate(prompt, params).token_ids
            assert len(first) == 6 and client.generate(prompt, params).token_ids == first
        # The workers really stored KV over mTLS: ask the master's Stats with a certificate of
        # the run's CA (found through the master's command line; this test is its owner).
        import pathlib

        from pdcluster.security.pki import ClusterCA

        master_argv = next(a for a in (_cmdline(p) for p in descendants(proc.pid)) if "--tls-client-ca" in a)
        tls_dir = pathlib.Path(master_argv[master_argv.index("--tls-client-ca") + 1]).parent
        probe = ClusterCA(tls_dir.parent).issue("client", "probe")
        creds = channel_credentials(TLSConfig(ca=probe.ca, cert=probe.cert, key=probe.key))
        with grpc.secure_channel(master, creds) as ch:
            stats = pb_grpc.KVStoreMasterStub(ch).Stats(pb.KVStatsRequest(), timeout=10)
        assert stats.counters["puts_completed"] > 0 and stats.hits > 0, stats
    finally:
        stop_serve(proc)
