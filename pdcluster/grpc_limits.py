"""What every gRPC server of the project sets besides its own options (router, workers, kvstore
master). Imports nothing: the router and the CLI load it without grpc's heavier parts.

A connection that has not finished its TLS handshake and HTTP/2 preface is closed after
SERVER_HANDSHAKE_TIMEOUT_MS. grpc's default is 120 s, so a local process opening connections and
sending nothing held each server's descriptors for two minutes apiece; loopback peers are all
one peer, so no per-peer cap tells them apart. 10 s is far above a handshake's milliseconds on a
LAN, and still leaves a slow WAN client room.
"""

from __future__ import annotations

SERVER_HANDSHAKE_TIMEOUT_MS = 10_000


def common_server_options() -> list[tuple[str, int]]:
    return [("grpc.server_handshake_timeout_ms", SERVER_HANDSHAKE_TIMEOUT_MS)]
