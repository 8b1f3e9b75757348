"""P2P EC connector options: EngineArgs.ec_connector_options, checked once into a frozen dataclass.

    keypair            "PUBLIC,SECRET" (pdcluster.security.keys.keypair_to_string) | KeyPair
    keys_dir, key_name alternatively: load the pair from a `pdcluster keys init` folder
    allowed_keys       the cluster's public keys ({name: key} or [key]); default: keys_dir/public.
                       Producer: who may use its control endpoint (ZAP allow-list). Consumer: which
                       producer keys an ec_transfer_params may name (anything else is refused).
    role               "both" (default) | "producer" | "consumer"
    host, port         control endpoint bind address (default 127.0.0.1, 0 = a free port)
    advertise_host     host to announce when binding a wildcard address
    data_host          TransferServer bind address (default: host)
    engine_id          this producer's id (default hostname-pid)
    lease_s            how long an announced item (and each fetch's grant) stays pinned
    max_bytes          producer region size; unleased items are evicted LRU to make room
    max_items          items the producer holds at most
    transport          "auto" (shared memory on one host, else TCP) | "tcp" | "shm"
    data_mac           check each TCP window's payload MAC (default true)
    request_timeout_s  one control round trip; fetch_timeout_s: one item, NOT_READY retries included
    io_timeout_s, num_load_threads
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from pdcluster.security.key_options import allowed_keys_option, keypair_option
from pdcluster.security.keys import KeyPair

ROLES = ("both", "producer", "consumer")
TRANSPORTS = ("auto", "tcp", "shm")
_FLOATS = ("lease_s", "request_timeout_s", "fetch_timeout_s", "io_timeout_s")
_INTS = ("max_bytes", "max_items", "num_load_threads")
_KNOWN = {"keypair", "keys_dir", "key_name", "allowed_keys", "role", "host", "port", "advertise_host",
          "data_host", "engine_id", "transport", "data_mac", *_FLOATS, *_INTS}


@dataclass(frozen=True)
class ECOptions:
    engine_id: str
    keypair: KeyPair
    allowed_keys: dict[str, bytes]
    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    data_host: str | None = None
    lease_s: float = 30.0
    max_bytes: int = 256 << 20
    max_items: int = 4096
    transport: str = "auto"
    data_mac: bool = True
    request_timeout_s: float = 2.0
    fetch_timeout_s: float = 10.0
    io_timeout_s: float = 10.0
    num_load_threads: int = 2
    keys_dir: str | None = None  # allowed_keys came from keys_dir/public: the control port follows it

    @property
    def is_producer(self) -> bool:
        return self.role in ("both", "producer")

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> ECOptions:
        unknown = sorted(set(options) - _KNOWN)
        if unknown:
            raise ValueError(f"unknown p2p_ec connector option(s) {unknown}; known: {sorted(_KNOWN)}")
        o = options
        kw: dict[str, Any] = {}
        for name in _FLOATS:
            if name in o:
                kw[name] = _number(name, o[name])
        for name in _INTS:
            if name in o:
                kw[name] = int(_number(name, o[name], integer=True))
        for name in ("host", "advertise_host", "data_host"):
            if name in o and o[name] is not None:
                kw[name] = str(o[name])
        if "port" in o:
            port = o["port"]
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
                raise ValueError(f"p2p_ec option port must be an integer in [0, 65535], got {port!r}")
            kw["port"] = port
        for name, choices in (("role", ROLES), ("transport", TRANSPORTS)):
            if name in o:
                if o[name] not in choices:
                    raise ValueError(f"p2p_ec option {name} must be one of {choices}, got {o[name]!r}")
                kw[name] = o[name]
        if "data_mac" in o:
            if not isinstance(o["data_mac"], bool):
                raise ValueError(f"p2p_ec option data_mac must be true or false, got {o['data_mac']!r}")
            kw["data_mac"] = o["data_mac"]
        engine_id = str(o.get("engine_id") or f"{socket.gethostname()}-{os.getpid()}")
        if not 0 < len(engine_id) <= 256:
            raise ValueError("p2p_ec engine_id must be 1..256 characters")
        keys_dir = str(o["keys_dir"]) if o.get("keys_dir") and o.get("allowed_keys") is None else None
        return cls(engine_id=engine_id, keypair=_keypair(o), allowed_keys=_allowed(o), keys_dir=keys_dir, **kw)


def _number(name: str, value: Any, integer: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float)) and value > 0
    if not ok:
        kind = "a positive integer" if integer else "a positive number"
        raise ValueError(f"p2p_ec option {name} must be {kind}, got {value!r}")
    return value


def _keypair(o: dict[str, Any]) -> KeyPair:
    return keypair_option(o, "p2p_ec", "ec_connector_options", "ec")


def _allowed(o: dict[str, Any]) -> dict[str, bytes]:
    return allowed_keys_option(o, "p2p_ec")
