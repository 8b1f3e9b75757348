"""Object MACs of the kvstore: the writer MACs each object under the store key, the master
records the MAC (PutEnd / CommitArena), and every reader checks it before using the bytes.

    mac = BLAKE3-keyed(store key, "pdkvob01" | len(key) u32 | key | size u64 | object bytes)

The store key (32 bytes) is shared by the workers only: the launcher hands it to each worker
process (environment, never request data); the master and the storage nodes never hold it, so
neither a storage node nor anyone on the data path can make a MAC for bytes of its choosing,
and the master cannot either. A reader with a key refuses an object whose MAC is missing or
differs (a miss for the caller, never wrong data). Binding the key name and size means an
object's bytes cannot be replayed under another key.
"""

from __future__ import annotations

import hmac
import os
import struct

import blake3

STORE_KEY_LEN = 32
MAC_LEN = 32
MAX_MAC_LEN = 64  # what the master accepts in a request (it stores the bytes, it cannot check them)
STORE_KEY_ENV = "PDCLUSTER_KVSTORE_OBJECT_KEY"  # hex, set by the launcher for worker processes
_HEAD = struct.Struct("!8sI")
_SIZE = struct.Struct("!Q")


def object_mac(store_key: bytes, key: str, data: memoryview) -> bytes:
    name = key.encode()
    h = blake3.blake3(_HEAD.pack(b"pdkvob01", len(name)) + name + _SIZE.pack(data.nbytes), key=store_key)
    h.update(data)
    return h.digest()


def mac_matches(store_key: bytes, key: str, data: memoryview, mac: bytes) -> bool:
    return len(mac) == MAC_LEN and hmac.compare_digest(object_mac(store_key, key, data), mac)


def check_store_key(store_key: bytes | str | None) -> bytes | None:
    """bytes (or hex) of exactly STORE_KEY_LEN, or None; ValueError otherwise."""
    if store_key is None:
        return None
    raw = bytes.fromhex(store_key) if isinstance(store_key, str) else bytes(store_key)
    if len(raw) != STORE_KEY_LEN:
        raise ValueError(f"the kvstore object key must be {STORE_KEY_LEN} bytes, got {len(raw)}")
    return raw


def store_key_from_env() -> bytes | None:
    value = os.environ.get(STORE_KEY_ENV)
    return check_store_key(value) if value else None
