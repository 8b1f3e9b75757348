"""P2P EC control messages (msgpack via pdcluster.security.envelope) and the compatibility
fingerprint.

Transport: CURVE DEALER (consumer) -> ROUTER (producer), ZAP allow-list of the cluster's keys.
Every request carries a fresh 16-byte nonce and a timestamp (a seen nonce or a stale time is
refused as a replay) and the consumer's compatibility fingerprint, checked on every request.
Each reply's first frame is the request's raw nonce, so a consumer drops a late reply to a request
it gave up on without decoding it.

    consumer                                        producer
    [ec_fetch {mm_hash, lease_id, fingerprint}] ->  [nonce, reply{status: ready, grant_id, token,
                                                     mac_key, region/offset/nbytes, shape, dtype,
                                                     digest, data address, host_id, shm_name}]
                                                    | not_ready (PENDING: retry) | missing | evicted
                                                    | incompatible | malformed | replayed | ...
    [ec_release {mm_hash, grant_id, lease_id}]  ->  [nonce, reply{status: released|expired}]
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from typing import Any

from pdcluster.security.envelope import Field, MessageSchema, schema_registry

CONNECTOR_VERSION = 1
MAX_FRAME_BYTES = 16 << 10  # control messages are small; anything larger is refused unread
NONCE_LEN = 16
DIGEST_LEN = 32  # blake3 of an item's bytes
MAX_DIMS = 4

_NONCE = Field(bytes, True, (NONCE_LEN, NONCE_LEN))
_TS = Field(int, True, (0, 1 << 62))
_HASH = Field(str, True, (64, 64))
_LEASE = Field(str, True, (0, 32))  # "" = no lease: best effort
_COUNT = Field(int, True, (0, 1 << 62))

FETCH = MessageSchema("ec_fetch", 1, {"nonce": _NONCE, "ts_ms": _TS, "fingerprint": _HASH, "mm_hash": _HASH,
                                      "lease_id": _LEASE})
RELEASE = MessageSchema("ec_release", 1, {"nonce": _NONCE, "ts_ms": _TS, "mm_hash": _HASH,
                                          "grant_id": Field(str, True, (32, 32)), "lease_id": _LEASE})
REPLY = MessageSchema("ec_reply", 1, {
    "ok": Field(bool, True), "status": Field(str, True, (1, 32)), "epoch": _COUNT,
    "error": Field(str, False, (0, 512)),
    "grant_id": Field(str, False, (32, 32)),
    "token": Field(bytes, False, (104, 104)), "mac_key": Field(bytes, False, (32, 32)),
    "region_id": Field(int, False, (1, 1 << 62)), "offset": Field(int, False, (0, 1 << 62)),
    "nbytes": Field(int, False, (1, 1 << 40)),
    "shape": Field(list, False, (1, MAX_DIMS), items=Field(int, True, (0, 1 << 31))),
    "dtype": Field(str, False, (1, 16)), "digest": Field(bytes, False, (DIGEST_LEN, DIGEST_LEN)),
    "data_host": Field(str, False, (1, 256)), "data_port": Field(int, False, (1, 65535)),
    "host_id": Field(str, False, (1, 512)), "shm_name": Field(str, False, (1, 128)),
    "region_nbytes": Field(int, False, (1, 1 << 44)),
})

REQUESTS = schema_registry(FETCH, RELEASE)
REPLIES = schema_registry(REPLY)

# Reply statuses. NOT_READY is the only retryable one.
READY, NOT_READY, MISSING, EVICTED = "ready", "not_ready", "missing", "evicted"
RELEASED, EXPIRED = "released", "expired"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_LEN)


def now_ms() -> int:
    return int(time.time() * 1000)


def fingerprint(encoder_fingerprint: str, dtype: str, hidden: int) -> str:
    """What must be equal for a producer's encoder outputs to be valid here: the encoder (model,
    vision + projector config, its dtype; llava_config.fingerprint), the output dtype and width, and
    this connector's wire version."""
    blob = json.dumps({"v": CONNECTOR_VERSION, "encoder": encoder_fingerprint, "dtype": dtype, "hidden": hidden},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def engine_fingerprint(engine_config: Any) -> str:
    from pdcluster.models.llava_config import load_llava_vision_config

    m = engine_config.model
    vision = load_llava_vision_config(m.model_path)
    return fingerprint(vision.fingerprint(m.model_path, m.dtype), m.dtype, vision.text_hidden_size)
