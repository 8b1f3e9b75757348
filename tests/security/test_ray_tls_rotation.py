"""A CA rotation reaches `pdcluster up`'s actors without a restart (cluster/ray_tls_push.py,
ray_tls_update.py), as real functions without Ray: the launcher's three-phase push over
in-process "actors" that rewrite their private TLS folders, a worker gRPC server on dynamic
credentials (as serve-worker runs) and the router's channel built from its files. After every
phase a new handshake router -> worker works; after `revoke-ca` an old-CA certificate is refused.
The whole thing on real Ray is in test_ray_tls_rotation_up.py (slow)."""

from __future__ import annotations

import shutil
from concurrent import futures

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdcluster.cluster.ray_tls import (
    ENV_CA,
    ENV_CERT,
    ENV_KEY,
    LauncherTLS,
    router_worker_tls,
    split_env,
    write_identity,
)
from pdcluster.cluster.ray_tls_push import push_rotation, refresh
from pdcluster.cluster.ray_tls_update import TLSUpdateError, apply_update
from pdcluster.router.worker_client import _credentials
from pdcluster.security.pki import begin_ca_rotation, finish_ca_rotation, init_pki
from pdcluster.security.rotation import dynamic_server_credentials
from pdcluster.worker.tls import TLSConfig, channel_tls_options

WORKER = ("worker", "both-0")
ROUTER = ("router", "router")


@pytest.fixture
def cluster(tmp_path):
    init_pki(tmp_path / "keys")
    tls = LauncherTLS(str(tmp_path / "keys"))
    paths = {}
    for actor, env in ((WORKER, tls.worker_env("both-0")), (ROUTER, tls.router_env())):
        paths[actor] = write_identity(split_env(env)[1], parent=str(tmp_path))
    w = paths[WORKER]
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", dynamic_server_credentials(w.cert, w.key, w.ca)[0])
    server.start()
    yield tls, paths, f"127.0.0.1:{port}", tmp_path
    server.stop(0)


def _check(addr: str, cfg: TLSConfig) -> int:
    opts = [*channel_tls_options(cfg), ("grpc.use_local_subchannel_pool", 1)]  # a new handshake each time
    with grpc.secure_channel(addr, _credentials(cfg), options=opts) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _local_send(paths, addr, checks):
    """The actors' update_tls, in process; after each phase a fresh router -> worker handshake."""
    def send(updates):
        out = {}
        for actor, update in updates.items():
            try:
                out[actor] = apply_update(paths[actor], update, *actor)
            except TLSUpdateError as e:
                out[actor] = e
        if any(updates.values()):
            checks.append(_check(addr, router_worker_tls(paths[ROUTER])))
        return out
    return send


def _issuer(path: str) -> str:
    return x509.load_pem_x509_certificate(open(path, "rb").read()).issuer.rfc4514_string()


def test_rotate_then_revoke_reaches_both_sides(cluster) -> None:
    tls, paths, addr, tmp = cluster
    serving = health_pb2.HealthCheckResponse.SERVING
    old = tmp / "old-router"  # the router's certificate before the rotation (old CA)
    shutil.copytree(paths[ROUTER].folder, old)
    checks: list[int] = []
    send = _local_send(paths, addr, checks)
    assert _check(addr, router_worker_tls(paths[ROUTER])) == serving
    old_issuer = tls.issuer

    begin_ca_rotation(tmp / "keys")  # `pdcluster keys rotate-ca`: bundle new + old
    assert tls.reload()
    report = push_rotation(tls, [WORKER, ROUTER], send)
    assert report["complete"], report
    assert checks == [serving] * 3  # after trust, reissue and prune: no failed handshake
    for p in paths.values():
        assert _issuer(p.cert) == tls.issuer != old_issuer
        assert len(x509.load_pem_x509_certificates(open(p.ca, "rb").read())) == 2
    assert _check(addr, TLSConfig(ca=paths[ROUTER].ca, cert=str(old / "cert.pem"), key=str(old / "key.pem"),
                                  server_name="pdcluster-worker")) == serving  # old CA still trusted

    finish_ca_rotation(tmp / "keys")  # `pdcluster keys revoke-ca`
    assert tls.reload()
    checks.clear()
    assert push_rotation(tls, [WORKER, ROUTER], send)["complete"]
    assert checks == [serving] * 3
    assert len(x509.load_pem_x509_certificates(open(paths[WORKER].ca, "rb").read())) == 1
    with pytest.raises(grpc.RpcError) as e:  # the worker no longer trusts the old CA's router
        _check(addr, TLSConfig(ca=paths[ROUTER].ca, cert=str(old / "cert.pem"), key=str(old / "key.pem"),
                               server_name="pdcluster-worker"))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _check(addr, router_worker_tls(paths[ROUTER])) == serving


def test_refused_updates_leave_the_files_alone(cluster) -> None:
    tls, paths, _, _ = cluster
    w = paths[WORKER]
    before = {f: open(f, "rb").read() for f in (w.cert, w.key, w.ca)}
    other = tls.worker_env("decode-0")  # another instance's identity
    mine, mine2 = tls.worker_env("both-0"), tls.worker_env("both-0")
    foreign = LauncherTLS(None)
    bad = [
        {**other},
        {ENV_CERT: mine[ENV_CERT], ENV_KEY: mine2[ENV_KEY], ENV_CA: mine[ENV_CA]},  # key of another cert
        {**foreign.worker_env("both-0")},  # another CA's certificate, with our bundle (below)
        {ENV_CA: foreign.bundle},  # a bundle that would not trust the current certificate
        {ENV_CERT: mine[ENV_CERT], ENV_CA: mine[ENV_CA]},  # a certificate without its key
        {ENV_CA: "not a PEM"},
    ]
    bad[2][ENV_CA] = mine[ENV_CA]
    for update in bad:
        with pytest.raises(TLSUpdateError):
            apply_update(w, update, *WORKER)
        assert {f: open(f, "rb").read() for f in before} == before
    assert apply_update(w, {}, *WORKER)["issuer"] == tls.issuer  # a question changes nothing
    assert {f: open(f, "rb").read() for f in before} == before


def test_restarted_actor_refreshed_after_a_rotation(cluster) -> None:
    tls, paths, addr, tmp = cluster
    start_up = {a: {n: open(getattr(p, n), "rb").read() for n in ("cert", "key", "ca")} for a, p in paths.items()}
    send = _local_send(paths, addr, [])
    begin_ca_rotation(tmp / "keys")
    tls.reload()
    finish_ca_rotation(tmp / "keys")
    tls.reload()
    assert push_rotation(tls, [WORKER, ROUTER], send)["complete"]
    assert refresh(tls, [WORKER, ROUTER], send) == {}  # nothing stale
    w = paths[WORKER]
    for name in ("cert", "key", "ca"):  # a restarted worker wrote its start-up identity (old CA)
        open(getattr(w, name), "wb").write(start_up[WORKER][name])
    with pytest.raises(grpc.RpcError):
        _check(addr, router_worker_tls(paths[ROUTER]))
    fixed = refresh(tls, [WORKER, ROUTER], send)
    assert list(fixed) == ["both-0"]
    assert _check(addr, router_worker_tls(paths[ROUTER])) == health_pb2.HealthCheckResponse.SERVING
