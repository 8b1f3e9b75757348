"""Mutual TLS on the internal gRPC planes by default (issue 16, item 1): a launcher that was
given no certificates makes a private cluster CA for this run (pdcluster/security/pki.py) in
its 0700 work folder and hands each process only its own identity, by file paths on the
child's command line (paths, never key material: /proc/PID/cmdline is world-readable).

    router   --  router certificate  -->  worker (serves its worker certificate, requires the CA)
    worker   --  worker certificate  -->  kvstore master (serves kvstore-master, requires the CA)
    kvstore node -- kvstore-node certificate --> kvstore master

A peer without a certificate of this CA fails the handshake; one of the CA but of another role
is refused by role (grpc_authz.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdcluster.security.pki import ClusterCA, Identity, init_pki

if TYPE_CHECKING:
    from pdcluster.worker.tls import TLSConfig


def make_internal_pki(workdir: str) -> ClusterCA:
    return init_pki(f"{workdir}/pki")


def server_argv(ident: Identity) -> list[str]:
    """A worker's (or the kvstore master's) serving identity plus the CA its clients must have."""
    return ["--tls-cert", ident.cert, "--tls-key", ident.key, "--tls-ca", ident.ca]


def client_tls(ident: Identity, server_name: str | None = None) -> TLSConfig:
    from pdcluster.worker.tls import TLSConfig

    return TLSConfig(ca=ident.ca, cert=ident.cert, key=ident.key, server_name=server_name)
