"""kv_transfer_params of the P2P connector: what a producer returns, what a consumer accepts.

Field names and types are those of the proto's KvTransferParams (proto/pdcluster/v1/common.proto),
so the params survive the trip through the router unchanged; the signature rides in
extra["p2p_sig"].

    do_remote_prefill   True (the decode leg sets it too)
    connector           "p2p"
    transfer_id         32 hex chars, unique, bound to request_id by the producer's lease
    producer_id         the producer engine's id (looked up in the consumer's peer registry)
    producer_rank, producer_tp_size, engine_epoch (the producer agent's incarnation)
    block_ids           the producer's leased blocks, in prompt order
    block_hashes        chained hashes of the prompt's full blocks (the consumer checks its prompt)
    num_tokens          prompt tokens covered; block_size
    remote_host, remote_port   data plane (informational: the consumer uses the handshake's)
    handshake_endpoint, producer_public_key   side channel (trusted only if signed or registered)
    lease_id, lease_expiry_time (Unix seconds, approximate: heartbeats renew it)
    extra               {"p2p_sig": HMAC of the routing fields} when params_secret is set;
                        {"p2p_ranks": JSON [[handshake_endpoint, epoch], ...] per producer TP rank}
                        when the producer has TP > 1 (signed too; every rank uses the producer's
                        one key pair, so CURVE still authenticates each rank's endpoint)
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any

from pdcluster.engine.request import Request

from .peer import params_signature

_HEX32 = re.compile(r"^[0-9a-f]{32}$")
MAX_BLOCK_ID = 1 << 31


def new_id() -> str:
    return secrets.token_hex(16)


def is_hex32(value: Any) -> bool:
    return isinstance(value, str) and bool(_HEX32.match(value))


def build_params(request: Request, block_ids: list[int], block_size: int, meta: dict[str, Any],
                 transfer_id: str, lease_id: str, lease_ttl_s: float, secret: bytes | None,
                 all_meta: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """meta: rank 0's handshake metadata (ProducerAgent); all_meta: every rank's, in rank order."""
    params: dict[str, Any] = {
        "do_remote_prefill": True, "do_remote_decode": False, "connector": "p2p",
        "transfer_id": transfer_id, "producer_id": meta["producer_id"], "producer_rank": 0,
        "producer_tp_size": meta["tp_size"], "engine_epoch": meta["epoch"], "block_ids": list(block_ids),
        "block_hashes": list(request.block_hashes[: request.num_prompt_tokens // block_size]),
        "num_tokens": request.num_prompt_tokens, "block_size": block_size,
        "remote_host": meta["data_host"], "remote_port": meta["data_port"],
        "handshake_endpoint": meta["handshake_endpoint"], "producer_public_key": meta["public_key"],
        "lease_id": lease_id, "lease_expiry_time": time.time() + lease_ttl_s,
    }
    if all_meta is not None and len(all_meta) > 1:
        params["extra"] = {"p2p_ranks": json.dumps([[m["handshake_endpoint"], m["epoch"]] for m in all_meta])}
    if secret is not None:
        params["extra"] = {**(params.get("extra") or {}), "p2p_sig": params_signature(secret, params)}
    return params


def producer_ranks(params: dict[str, Any]) -> list[tuple[str, int]]:
    """[(handshake_endpoint, epoch)] per producer rank; rank 0 from the top-level fields."""
    tp = params.get("producer_tp_size") or 1
    if not _is_int(tp) or not 1 <= tp <= 1024:
        raise ValueError(f"kv_transfer_params.producer_tp_size: must be 1..1024, got {tp!r}")
    if tp == 1:
        return [(str(params.get("handshake_endpoint") or ""), int(params["engine_epoch"]))]
    raw = (params.get("extra") or {}).get("p2p_ranks")
    try:
        ranks = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        ranks = None
    if not isinstance(ranks, list) or len(ranks) != tp or not all(
            isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and _is_int(r[1]) for r in ranks):
        raise ValueError(f"kv_transfer_params.extra.p2p_ranks: must list {tp} [endpoint, epoch] pairs")
    return [(r[0], r[1]) for r in ranks]


def check_consumer_params(params: dict[str, Any], request: Request, block_size: int) -> None:
    """ValueError naming the field when the params cannot describe this request's prompt KV."""
    def need(name: str, ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"kv_transfer_params.{name}: {what}, got {str(params.get(name))[:80]!r}")

    need("connector", params.get("connector", "p2p") in ("p2p", ""), "must be 'p2p'")
    need("producer_id", isinstance(params.get("producer_id"), str) and 0 < len(params["producer_id"]) <= 256,
         "must name the producer")
    need("transfer_id", is_hex32(params.get("transfer_id")), "must be 32 hex characters")
    need("lease_id", is_hex32(params.get("lease_id")), "must be 32 hex characters")
    need("engine_epoch", _is_int(params.get("engine_epoch")) and params["engine_epoch"] > 0, "must be positive")
    need("block_size", params.get("block_size") == block_size, f"must equal this engine's block_size {block_size}")
    n = request.num_prompt_tokens
    need("num_tokens", params.get("num_tokens") == n, f"must equal the prompt's {n} tokens (same prompt on both legs)")
    ids = params.get("block_ids")
    need("block_ids", isinstance(ids, list) and len(ids) == -(-n // block_size)
         and all(_is_int(b) and 0 <= b < MAX_BLOCK_ID for b in ids), f"must list {-(-n // block_size)} block ids")
    hashes = params.get("block_hashes") or []
    mine = request.block_hashes[: n // block_size]
    need("block_hashes", not hashes or [bytes(h) for h in hashes] == mine,
         "do not match this prompt (the decode leg must carry the prefill leg's prompt)")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
