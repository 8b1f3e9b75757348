"""The P2P connector's KVTransferParams: what a producer returns, what a consumer accepts.

The params are the core's typed KVTransferParams (pdcluster/engine/kv_transfer_params.py); P2P
uses these of its fields:

    do_remote_prefill   True (the decode leg sets it too)
    connector           "p2p"
    request_id          the producer's request id (its lease is bound to it)
    transfer_id         32 hex chars, unique, bound to request_id by the producer's lease
    producer_id         the producer engine's id (looked up in the consumer's peer registry)
    producer_rank, producer_tp_size, engine_epoch (the producer agent's incarnation)
    block_ids           the producer's leased blocks, in prompt order
    block_hashes        chained hashes of the prompt's full blocks (the consumer checks its prompt)
    num_tokens          prompt tokens covered; block_size
    remote_host, remote_port   data plane (informational: the consumer uses the handshake's)
    handshake_endpoint, producer_public_key   side channel (trusted only if signed or registered)
    lease_id, lease_expiry_time (Unix seconds, approximate: heartbeats renew it)

and keeps what is its own in `extra`, read and written through P2PExtra (below) so the rest of
the connector never touches extra's keys:

    extra["p2p_sig"]    HMAC of the routing fields, when params_secret is set
    extra["p2p_ranks"]  JSON [[handshake_endpoint, epoch], ...] per producer TP rank, when the
                        producer has TP > 1 (signed too; every rank uses the producer's one key
                        pair, so CURVE still authenticates each rank's endpoint)

Both stay strings: the signature covers p2p_ranks exactly as sent, and the wire is unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from pdcluster.engine.kv_connector import ExtraValue, KVTransferParams
from pdcluster.engine.request import Request

_HEX32 = re.compile(r"^[0-9a-f]{32}$")
MAX_BLOCK_ID = 1 << 31
SIG_KEY, RANKS_KEY = "p2p_sig", "p2p_ranks"


def new_id() -> str:
    return secrets.token_hex(16)


def is_hex32(value: Any) -> bool:
    return isinstance(value, str) and bool(_HEX32.match(value))


@dataclass(frozen=True)
class P2PExtra:
    """P2P's entries of KVTransferParams.extra. ranks_json is kept as sent: the signature covers it."""

    signature: str = ""
    ranks_json: str = ""

    @classmethod
    def of(cls, params: KVTransferParams) -> P2PExtra:
        sig, ranks = params.extra.get(SIG_KEY, ""), params.extra.get(RANKS_KEY, "")
        if not isinstance(sig, str):
            raise ValueError(f"kv_transfer_params.extra.{SIG_KEY}: must be a string")
        if not isinstance(ranks, str):
            raise ValueError(f"kv_transfer_params.extra.{RANKS_KEY}: must be a JSON string")
        return cls(sig, ranks)

    def into(self, extra: Mapping[str, ExtraValue]) -> dict[str, ExtraValue]:
        """extra with these entries set (an empty one left out)."""
        out = dict(extra)
        for key, value in ((RANKS_KEY, self.ranks_json), (SIG_KEY, self.signature)):
            if value:
                out[key] = value
        return out


def params_signature(secret: bytes, params: KVTransferParams) -> str:
    """HMAC over the fields that tell a consumer where to go and whom to trust."""
    ranks = P2PExtra.of(params).ranks_json
    signed = msgpack.packb(["pdcluster-p2p-params-v1", params.producer_id, params.handshake_endpoint,
                            params.producer_public_key, params.engine_epoch] + ([ranks] if ranks else []),
                           use_bin_type=True)
    return hmac.new(secret, signed, hashlib.sha256).hexdigest()


def build_params(request: Request, block_ids: list[int], block_size: int, meta: dict[str, Any],
                 transfer_id: str, lease_id: str, lease_ttl_s: float, secret: bytes | None,
                 all_meta: list[dict[str, Any]] | None = None) -> KVTransferParams:
    """meta: rank 0's handshake metadata (ProducerAgent); all_meta: every rank's, in rank order."""
    params = KVTransferParams(
        do_remote_prefill=True, do_remote_decode=False, connector="p2p", request_id=request.request_id,
        transfer_id=transfer_id, producer_id=meta["producer_id"], producer_rank=0,
        producer_tp_size=meta["tp_size"], engine_epoch=meta["epoch"], block_ids=tuple(block_ids),
        block_hashes=tuple(request.block_hashes[: request.num_prompt_tokens // block_size]),
        num_tokens=request.num_prompt_tokens, block_size=block_size,
        remote_host=meta["data_host"], remote_port=meta["data_port"],
        handshake_endpoint=meta["handshake_endpoint"], producer_public_key=meta["public_key"],
        lease_id=lease_id, lease_expiry_time=time.time() + lease_ttl_s,
    )
    if all_meta is not None and len(all_meta) > 1:
        ranks = json.dumps([[m["handshake_endpoint"], m["epoch"]] for m in all_meta])
        params = params.replace(extra=P2PExtra(ranks_json=ranks).into(params.extra))
    if secret is not None:
        extra = P2PExtra.of(params)
        signed = P2PExtra(params_signature(secret, params), extra.ranks_json)
        params = params.replace(extra=signed.into(params.extra))
    return params


def producer_ranks(params: KVTransferParams) -> list[tuple[str, int]]:
    """[(handshake_endpoint, epoch)] per producer rank; rank 0 from the top-level fields."""
    tp = params.producer_tp_size or 1
    if not 1 <= tp <= 1024:
        raise ValueError(f"kv_transfer_params.producer_tp_size: must be 1..1024, got {tp!r}")
    if tp == 1:
        return [(params.handshake_endpoint, params.engine_epoch)]
    raw = P2PExtra.of(params).ranks_json
    try:
        ranks = json.loads(raw) if raw else None
    except ValueError:
        ranks = None
    if not isinstance(ranks, list) or len(ranks) != tp or not all(
            isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and _is_int(r[1]) for r in ranks):
        raise ValueError(f"kv_transfer_params.extra.p2p_ranks: must list {tp} [endpoint, epoch] pairs")
    return [(r[0], r[1]) for r in ranks]


def check_consumer_params(params: KVTransferParams, request: Request, block_size: int) -> None:
    """ValueError naming the field when the params cannot describe this request's prompt KV."""
    def need(name: str, ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"kv_transfer_params.{name}: {what}, got {str(getattr(params, name))[:80]!r}")

    need("connector", params.connector in ("p2p", ""), "must be 'p2p'")
    need("producer_id", 0 < len(params.producer_id) <= 256, "must name the producer")
    need("transfer_id", is_hex32(params.transfer_id), "must be 32 hex characters")
    need("lease_id", is_hex32(params.lease_id), "must be 32 hex characters")
    need("engine_epoch", params.engine_epoch > 0, "must be positive")
    need("block_size", params.block_size == block_size, f"must equal this engine's block_size {block_size}")
    n = request.num_prompt_tokens
    need("num_tokens", params.num_tokens == n, f"must equal the prompt's {n} tokens (same prompt on both legs)")
    ids = params.block_ids
    need("block_ids", len(ids) == -(-n // block_size) and all(b < MAX_BLOCK_ID for b in ids),
         f"must list {-(-n // block_size)} block ids")
    hashes = params.block_hashes
    mine = request.block_hashes[: n // block_size]
    need("block_hashes", not hashes or list(hashes) == mine,
         "do not match this prompt (the decode leg must carry the prefill leg's prompt)")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
