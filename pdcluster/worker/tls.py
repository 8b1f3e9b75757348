"""TLS and mutual TLS for pdcluster's gRPC servers and clients, from PEM files.

    server: TLSConfig(cert=server.pem, key=server.key)               -> TLS
            TLSConfig(cert=..., key=..., ca=clients-ca.pem)           -> mTLS (client certs required)
    client: TLSConfig(ca=server-ca.pem)                               -> verify the server
            TLSConfig(ca=..., cert=client.pem, key=client.key)        -> and present a client cert

Without a TLSConfig the server listens in plaintext; DESIGN.md section 9 keeps that to loopback
by default (binding elsewhere is an explicit choice of the operator).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import grpc

_MAX_PEM_BYTES = 1 << 20


@dataclass(frozen=True)
class TLSConfig:
    cert: str | None = None  # PEM certificate chain (server: required; client: for mTLS)
    key: str | None = None  # PEM private key of `cert`
    ca: str | None = None  # server: CA of allowed client certs (turns on mTLS); client: server CA
    server_name: str | None = None  # client: override the name checked in the server cert

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("tls: cert and key must be given together")


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"tls: {what} file {path} does not exist")
    if p.stat().st_size > _MAX_PEM_BYTES:
        raise ValueError(f"tls: {what} file {path} is too large for a PEM file")
    data = p.read_bytes()
    if b"-----BEGIN" not in data:
        raise ValueError(f"tls: {what} file {path} is not PEM")
    return data


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    if tls.cert is None or tls.key is None:
        raise ValueError("tls: a server needs cert and key")
    cert, key = _read(tls.cert, "cert"), _read(tls.key, "key")
    ca = _read(tls.ca, "client CA")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca, "CA"), private_key=_read(tls.key, "key"),
                                        certificate_chain=_read(tls.cert, "cert"))


def channel_tls_options(tls: TLSConfig | None) -> list[tuple[str, str]]:
    if tls is None or tls.server_name is None:
        return []
    return [("grpc.ssl_target_name_override", tls.server_name)]
