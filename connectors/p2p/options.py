"""P2P connector options: EngineArgs.kv_connector_options, checked once into a frozen dataclass.

    keypair            "PUBLIC,SECRET" (pdcluster.security.keys.keypair_to_string) | KeyPair
    keys_dir, key_name alternatively: load the pair from a `pdcluster keys init` folder
    allowed_keys       the cluster's public keys ({name: key} or [key]); default: keys_dir/public.
                       Producer: who may use its side channel. Consumer: which producer keys a
                       signed kv_transfer_params may name.
    peers              {producer_id: {"endpoint": "tcp://host:port", "public_key": key}}: the
                       peer registry; an entry wins over anything in the params
    params_secret      hex or bytes (>= 32 B) shared by the cluster: the producer signs the
                       handshake endpoint and key it puts in kv_transfer_params; a consumer
                       accepts a producer that is not in `peers` only with a valid signature
    engine_id          this engine's producer_id (default: hostname-pid)
    side_channel_bind  ZMQ bind address (default tcp://127.0.0.1:*; elsewhere is explicit)
    advertise_host     host to put in the endpoint when binding a wildcard address
    data_host          TransferServer bind address (default 127.0.0.1)
    transport          "auto" (shared memory on one host, else TCP) | "tcp" | "shm"
    lease_ttl_s        producer lease lifetime, renewed by consumer heartbeats
    failure_policy     "fail" | "recompute"
    data_mac           consumer: check every TCP window's payload MAC (default true; false only to
                       measure its cost); a mismatch fails the load's blocks like any other error
    timeouts, streams  request_timeout_s, connect_timeout_s, io_timeout_s, num_streams,
                       min_stream_bytes, num_load_threads, open_retry_s
    debug_pause_before_read_s   fault injection for tests: a consumer waits after opening
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from pdcluster.config import EngineConfig
from pdcluster.security.key_options import allowed_keys_option, keypair_option
from pdcluster.security.keys import KeyPair, normalize_public_key

TRANSPORTS = ("auto", "tcp", "shm")
_KNOWN = {
    "keypair", "keys_dir", "key_name", "allowed_keys", "peers", "params_secret", "engine_id",
    "side_channel_bind", "advertise_host", "data_host", "transport", "lease_ttl_s", "failure_policy",
    "request_timeout_s", "connect_timeout_s", "io_timeout_s", "num_streams", "min_stream_bytes",
    "num_load_threads", "open_retry_s", "debug_pause_before_read_s", "data_mac",
}


@dataclass(frozen=True)
class PeerEntry:
    endpoint: str
    public_key: bytes  # Z85


@dataclass(frozen=True)
class P2POptions:
    engine_id: str
    kv_role: str
    keypair: KeyPair
    allowed_keys: dict[str, bytes]
    peers: dict[str, PeerEntry] = field(default_factory=dict)
    params_secret: bytes | None = None
    side_channel_bind: str = "tcp://127.0.0.1:*"
    advertise_host: str | None = None
    data_host: str = "127.0.0.1"
    transport: str = "auto"
    lease_ttl_s: float = 30.0
    failure_policy: str = "fail"
    request_timeout_s: float = 5.0
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 10.0
    num_streams: int = 4
    # A stream per 8 MiB at most: every extra stream is a request, a server thread and a MAC key
    # set-up, and the wake-ups of one more connection. Measured on a 2-vCPU box with the MAC on
    # (benchmarks/RESULTS.md, session 32): a 256-token bench-Llama hand-off's 3 MiB loaded in
    # 4.7-5.6 ms with one stream against 5.3-6.4 with four, 12 MiB in 6.6 against 7.6 ms; at
    # 128 MiB four streams win (3.05-3.39 GB/s against 2.41-3.06 with one).
    min_stream_bytes: int = 8 << 20
    num_load_threads: int = 2
    open_retry_s: float = 2.0
    debug_pause_before_read_s: float = 0.0
    data_mac: bool = True
    keys_dir: str | None = None  # allowed_keys came from keys_dir/public: the server follows it

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("consumer", "both")

    @classmethod
    def from_dict(cls, options: dict[str, Any], engine_config: EngineConfig) -> P2POptions:
        unknown = sorted(set(options) - _KNOWN)
        if unknown:
            raise ValueError(f"unknown p2p connector option(s) {unknown}; known: {sorted(_KNOWN)}")
        o = options
        keypair = _keypair(o)
        allowed = _allowed(o)
        transport = o.get("transport", "auto")
        if transport not in TRANSPORTS:
            raise ValueError(f"p2p transport must be one of {TRANSPORTS}, got {transport!r}")
        engine_id = str(o.get("engine_id") or f"{socket.gethostname()}-{os.getpid()}")
        if not 0 < len(engine_id) <= 256:
            raise ValueError("p2p engine_id must be 1..256 characters")
        kw: dict[str, Any] = {}
        for name in ("lease_ttl_s", "request_timeout_s", "connect_timeout_s", "io_timeout_s", "open_retry_s",
                     "debug_pause_before_read_s"):
            if name in o:
                kw[name] = _positive(name, o[name], allow_zero=name in ("open_retry_s", "debug_pause_before_read_s"))
        for name in ("num_streams", "min_stream_bytes", "num_load_threads"):
            if name in o:
                kw[name] = int(_positive(name, o[name]))
        for name in ("side_channel_bind", "advertise_host", "data_host", "failure_policy"):
            if name in o:
                kw[name] = str(o[name])
        if "data_mac" in o:
            if not isinstance(o["data_mac"], bool):
                raise ValueError(f"p2p option data_mac must be true or false, got {o['data_mac']!r}")
            kw["data_mac"] = o["data_mac"]
        if kw.get("failure_policy", "fail") not in ("fail", "recompute"):
            raise ValueError(f"failure_policy must be 'fail' or 'recompute', got {kw['failure_policy']!r}")
        return cls(engine_id=engine_id, kv_role=engine_config.kv_role, keypair=keypair, allowed_keys=allowed,
                   peers=_peers(o.get("peers") or {}), params_secret=_secret(o.get("params_secret")),
                   transport=transport,
                   keys_dir=str(o["keys_dir"]) if o.get("keys_dir") and o.get("allowed_keys") is None else None, **kw)


def _positive(name: str, value: Any, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"p2p option {name} must be a positive number, got {value!r}")
    return float(value)


def _keypair(o: dict[str, Any]) -> KeyPair:
    return keypair_option(o, "p2p", "kv_connector_options", "p2p")


def _allowed(o: dict[str, Any]) -> dict[str, bytes]:
    return allowed_keys_option(o, "p2p")


def _peers(peers: Any) -> dict[str, PeerEntry]:
    if not isinstance(peers, dict):
        raise ValueError("p2p option peers must be {producer_id: {endpoint, public_key}}")
    out = {}
    for pid, entry in peers.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("endpoint"), str):
            raise ValueError(f"p2p peer {pid!r} needs an 'endpoint' and a 'public_key'")
        check_endpoint(entry["endpoint"])
        out[str(pid)] = PeerEntry(entry["endpoint"], normalize_public_key(entry["public_key"]))
    return out


def _secret(value: Any) -> bytes | None:
    if value is None:
        return None
    secret = bytes.fromhex(value) if isinstance(value, str) else value
    if not isinstance(secret, bytes) or len(secret) < 32:
        raise ValueError("p2p params_secret must be at least 32 bytes (hex string or bytes)")
    return secret


def check_endpoint(endpoint: str) -> str:
    """Only tcp://host:port: a params-supplied endpoint must not reach ipc:// or inproc:// sockets."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://") or len(endpoint) > 300:
        raise ValueError(f"p2p endpoint must be tcp://HOST:PORT, got {str(endpoint)[:80]!r}")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "*" in host:
        raise ValueError(f"p2p endpoint must be tcp://HOST:PORT, got {endpoint[:80]!r}")
    return endpoint
