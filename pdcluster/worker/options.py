"""gRPC options shared by every pdcluster server and channel.

Message-size limits are explicit on both ends: gRPC's 4 MiB default receive limit would reject a
long prompt's token ids or a long non-streamed answer with an opaque error, and an unbounded
limit lets one client make the server buffer arbitrary amounts. An oversize message is refused
by gRPC itself with RESOURCE_EXHAUSTED before any handler runs.
"""

from __future__ import annotations

from pdcluster.grpc_limits import common_server_options

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # ~16M token ids; far above any max_model_len we serve
KEEPALIVE_TIME_MS = 30_000  # detect dead peers on idle connections (NAT and LB timeouts)
KEEPALIVE_TIMEOUT_MS = 10_000
# Caps per peer connection and per server (issue 16): far above what a router sends (one
# multiplexed stream, or one call per request up to its max_inflight), low enough that one peer
# cannot open unbounded streams. More streams on a connection wait; more calls -> RESOURCE_EXHAUSTED.
MAX_CONCURRENT_STREAMS = 4096
MAX_CONCURRENT_RPCS = 16384


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    _check(max_message_bytes)
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # A second server on the same port must fail to bind, not silently share the traffic.
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # Clients (routers) ping idle long-lived channels; accept that instead of GOAWAY-ing them.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        *common_server_options(),
    ]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    _check(max_message_bytes)
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def _check(max_message_bytes: int) -> None:
    if not isinstance(max_message_bytes, int) or not 1024 <= max_message_bytes <= (1 << 31) - 1:
        raise ValueError(f"max_message_bytes must be an integer in [1024, 2**31-1], got {max_message_bytes!r}")
