"""`pdcluster up` (Ray) runs router <-> worker gRPC over mutual TLS by default (issue 16, item
1): the launcher's CA issues each actor its own certificate (PEM in the actor's start-up
environment); the worker child gets only file paths. A plaintext gRPC peer and a router
certificate of another CA are refused by the worker; requests through the router still work."""

from __future__ import annotations

import json
import os
import pathlib

import grpc
import pytest
import ray_up
from security.deploy_probes import wait_refusals

from pdcluster.cluster.ray_tls import ENV_KEY, WORKER_SERVER_NAME
from pdcluster.security.pki import init_pki
from pdcluster.worker.tls import TLSConfig, channel_credentials

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def cluster_env(tmp_path):
    yield from ray_up.cluster_env(tmp_path, "tls")


def _health(addr: str, creds: grpc.ChannelCredentials | None) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    opts = [("grpc.ssl_target_name_override", WORKER_SERVER_NAME)] if creds else []
    with (grpc.secure_channel(addr, creds, options=opts) if creds else grpc.insecure_channel(addr)) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_up_workers_refuse_plaintext_and_other_ca(cluster_env, tmp_path) -> None:
    from pdcluster import SamplingParams
    from pdcluster.client import Client

    env, ns = cluster_env
    up = ray_up.cli(env, "up", "--detach", "--workers", "1", "--grpc-port", "0", "--http-port", "-1", "--namespace", ns,
             "--num-cpus", "2", "--no-dashboard", timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    ready = json.loads(next(x for x in up.stdout.splitlines() if x.startswith("PDCLUSTER_READY ")).split(" ", 1)[1])
    (inst,) = ready["instances"].values()
    worker = inst["address"]
    foreign = init_pki(tmp_path / "other").issue("router", "router")
    foreign_creds = channel_credentials(TLSConfig(ca=foreign.ca, cert=foreign.cert, key=foreign.key))
    for creds in (None, foreign_creds):
        with pytest.raises(grpc.RpcError) as e:
            _health(worker, creds)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # Both refusals are counted on the worker's /metrics (security/tls_audit.py), each named
    # 127.0.0.1 or "unseen" (a client that reset the connection before the audit read). gRPC's
    # channel may try a refused handshake again before the probe closes it: at least two.
    refused, named, unseen = wait_refusals(inst["metrics"], "worker", 2)
    assert refused >= 2 and named + unseen == refused
    with Client(ready["grpc"], timeout=120) as client:  # the router's own certificate works
        out = client.generate(list(range(5, 20)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out.token_ids) == 3
    # The worker child holds its identity as files (0600 in a 0700 folder), not in its environment.
    child = inst["child_pid"]
    argv = [a.decode() for a in pathlib.Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0") if a]
    key = argv[argv.index("--tls-key") + 1]
    assert os.stat(key).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(key)).st_mode & 0o777 == 0o700
    assert ENV_KEY.encode() not in pathlib.Path(f"/proc/{child}/environ").read_bytes()
    down = ray_up.cli(env, "down", "--namespace", ns, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not os.path.exists(key)
