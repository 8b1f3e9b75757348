"""gRPC plumbing for the kvstore: TLS/mTLS credentials, channels, status mapping.

Default is insecure gRPC on 127.0.0.1. Binding elsewhere is explicit; pass a certificate and key
to serve TLS, plus a client CA to require client certificates (mTLS).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import grpc

MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None, *,
                       on_handshake: Callable[[], None] | None = None) -> grpc.ServerCredentials:
    """Credentials that follow the files: gRPC re-reads a reissued certificate or CA bundle at
    the next handshake (pdcluster/security/rotation.py), so rotation needs no restart.
    on_handshake: called before each new connection's handshake (security/tls_audit.py)."""
    from pdcluster.security.rotation import dynamic_server_credentials

    return dynamic_server_credentials(cert_file, key_file, client_ca_file, on_handshake=on_handshake)[0]


def make_channel(addr: str, *, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None) -> grpc.Channel:
    """Insecure channel unless a CA is given; cert+key add a client certificate (mTLS)."""
    if tls_ca is None:
        return grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(tls_ca),
        private_key=_read(tls_key) if tls_key else None,
        certificate_chain=_read(tls_cert) if tls_cert else None,
    )
    return grpc.secure_channel(addr, creds, options=CHANNEL_OPTIONS)


def add_tls_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", default=None, help="serve gRPC over TLS with this certificate (PEM)")
    p.add_argument("--tls-key", default=None, help="private key of --tls-cert (PEM)")
    p.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA (mTLS)")


def add_tls_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=None, help="talk TLS to the master, trusting this CA (PEM)")
    p.add_argument("--tls-cert", default=None, help="client certificate for mTLS (PEM)")
    p.add_argument("--tls-key", default=None, help="private key of --tls-cert (PEM)")
