"""P2P side-channel messages (msgpack via pdcluster.security.envelope) and the compatibility
fingerprint.

Transport: CURVE DEALER (consumer) -> ROUTER (producer). Every request carries a fresh 16-byte
nonce and a timestamp; the producer refuses a nonce it has seen (replay) or a stale timestamp.
Every reply starts with the request's raw nonce as its own frame, so a consumer matches replies
to requests without decoding anything it did not ask for (a late reply to a timed-out request is
dropped).

    consumer                                  producer
    [hs_req]                           ->     [nonce, fp, hs_body]     two-phase: decode fp, compare,
                                                                       only then decode hs_body
    [open  {request_id, transfer_id, lease_id, first_block}]
                                       ->     [nonce, reply{block_ids, tokens, mac_keys, expiry_ms, ttl_ms}]
    [heartbeat {leases}]               ->     [nonce, reply{alive}]
    [done  {request_id, transfer_id, lease_id, ok}]
                                       ->     [nonce, reply{status: released|expired|unknown}]
    anything malformed                 ->     [nonce or b"", reply{ok: false, error}]
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict
from typing import Any

from pdcluster.config import EngineConfig
from pdcluster.security.envelope import Field, MessageSchema, schema_registry

FP8_KV_DTYPES = ("float8_e4m3fn",)  # resolved kv_cache_dtype names whose bytes are scaled
CONNECTOR_VERSION = 1
BODY_VERSION = 1
MAX_FRAME_BYTES = 64 << 10  # control messages are small; a block list of 8k ids fits easily
MAX_BLOCKS = 1 << 16
NONCE_LEN = 16

_NONCE = Field(bytes, True, (NONCE_LEN, NONCE_LEN))
_TS = Field(int, True, (0, None))
_ID = Field(str, True, (1, 256))
_HEX32 = Field(str, True, (32, 32))
_COUNT = Field(int, True, (0, 1 << 62))

FINGERPRINT = MessageSchema("p2p_fp", 1, {
    "model": Field(str, True, (1, 128)), "dtype": Field(str, True, (1, 32)), "kv_dtype": Field(str, True, (1, 32)),
    "num_layers": _COUNT, "num_kv_heads": _COUNT, "head_dim": _COUNT, "block_size": _COUNT,
    "layout": Field(str, True, (1, 16)), "connector_version": _COUNT, "body_version": _COUNT,
    "kv_scales": Field(str, False, (1, 64)),  # fp8 caches only
    "window_handoff": Field(str, False, (1, 16)),  # every layer slides: only the window's tail is sent
})
HS_REQ = MessageSchema("p2p_hs_req", 1, {"nonce": _NONCE, "ts_ms": _TS, "consumer_id": _ID,
                                          "fingerprint": Field(dict, True, (0, 32))})
HS_BODY = MessageSchema("p2p_hs_body", BODY_VERSION, {
    "producer_id": _ID, "epoch": _COUNT, "tp_rank": _COUNT, "tp_size": _COUNT,
    "data_host": Field(str, True, (1, 256)), "data_port": Field(int, True, (1, 65535)),
    "region_id": _COUNT, "region_nbytes": _COUNT, "num_blocks": _COUNT, "block_nbytes": _COUNT,
    "host_id": Field(str, True, (1, 512)), "shm_name": Field((str, type(None)), False, (1, 128)),
})
OPEN = MessageSchema("p2p_open", 1, {"nonce": _NONCE, "ts_ms": _TS, "request_id": _ID, "transfer_id": _HEX32,
                                     "lease_id": _HEX32, "first_block": Field(int, True, (0, MAX_BLOCKS))})
_LEASE_REF = MessageSchema("lease_ref", 1, {"lease_id": _HEX32, "transfer_id": _HEX32})
HEARTBEAT = MessageSchema("p2p_heartbeat", 1, {"nonce": _NONCE, "ts_ms": _TS,
                                               "leases": Field(list, True, (1, 1024), items=_LEASE_REF)})
DONE = MessageSchema("p2p_done", 1, {"nonce": _NONCE, "ts_ms": _TS, "request_id": _ID, "transfer_id": _HEX32,
                                     "lease_id": _HEX32, "ok": Field(bool, True),
                                     # heterogeneous TP: which consumer rank of how many says done
                                     "consumer_rank": Field(int, False, (0, 1 << 16)),
                                     "consumer_tp": Field(int, False, (1, 1 << 16))})
REPLY = MessageSchema("p2p_reply", 1, {
    "ok": Field(bool, True), "epoch": _COUNT, "error": Field((str, type(None)), False, (0, 512)),
    "block_ids": Field(list, False, (0, MAX_BLOCKS), items=Field(int, True, (0, 1 << 31))),
    "tokens": Field(list, False, (0, 1024), items=Field(bytes, True, (104, 104))),
    # one per token: its payload MAC key (pdcluster.transfer.integrity), only ever sent over CURVE
    "mac_keys": Field(list, False, (0, 1024), items=Field(bytes, True, (32, 32))),
    "expiry_ms": Field(int, False, (0, None)), "ttl_ms": Field(int, False, (0, None)),
    "alive": Field(list, False, (0, 1024), items=Field(str, True, (32, 32))),
    "status": Field(str, False, (1, 32)),
})

REQUESTS = schema_registry(HS_REQ, OPEN, HEARTBEAT, DONE)
REPLIES = schema_registry(REPLY)
FINGERPRINTS = schema_registry(FINGERPRINT)
HS_BODIES = schema_registry(HS_BODY)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_LEN)


def now_ms() -> int:
    return int(time.time() * 1000)


def model_digest(engine_config: EngineConfig) -> str:
    """Identity of the model's architecture and weights' shape, stable across hosts (the path and
    max_model_len may differ between pools and do not change the KV)."""
    m = asdict(engine_config.model)
    for k in ("model_path", "max_model_len", "max_position_embeddings", "eos_token_ids", "bos_token_id",
              "expert_parallel"):  # how experts are placed on ranks does not change the KV
        m.pop(k, None)
    return hashlib.sha256(json.dumps(m, sort_keys=True, default=str).encode()).hexdigest()[:32]


def fingerprint(engine_config: EngineConfig) -> dict[str, Any]:
    """What must be equal for a producer's blocks to be valid in a consumer's cache. TP sizes are
    not in it: they are checked at run time from the handshake body."""
    m, c = engine_config.model, engine_config.cache
    fp = {"model": model_digest(engine_config), "dtype": m.dtype, "kv_dtype": c.kv_cache_dtype,
          "num_layers": m.num_hidden_layers, "num_kv_heads": m.num_key_value_heads, "head_dim": m.head_dim,
          "block_size": c.block_size, "layout": "NHD", "connector_version": CONNECTOR_VERSION,
          "body_version": BODY_VERSION}
    if m.kv_window is not None:  # the hand-off sends only the window's tail (p2p/scheduler_side.py)
        fp["window_handoff"] = "tail"
    if c.kv_cache_dtype in FP8_KV_DTYPES:  # fp8 bytes mean value / scale: the scales must match too
        from pdcluster.models.layers.kv_quant import kv_scales_digest  # lazy: torch

        fp["kv_scales"] = kv_scales_digest(m.model_path, m.num_hidden_layers, m.num_key_value_heads)
    return fp


def fingerprint_mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """None when compatible, else which fields differ."""
    diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    if not diff:
        return None
    problem = "incompatible KV caches: " + ", ".join(f"{k} ours={ours.get(k)!r} theirs={theirs.get(k)!r}" for k in diff)
    if "kv_dtype" in diff:  # the deployment knob to fix, by its option name
        problem += " (producer and consumer must run with the same kv_cache_dtype: an fp8 cache's bytes are not " \
                   "another dtype's)"
    elif "kv_scales" in diff:
        problem += " (the fp8 KV cache scales differ: producer and consumer must load the same checkpoint's " \
                   "k_scale/v_scale, or both none)"
    return problem
