"""What a prefill (producer) leg may carry, checked field by field.

The router sends the prefill leg `do_remote_decode=true` and at most the connector's name and,
in concurrent mode, the transfer_id it admitted the decode leg under (32 hex characters; the
producer binds its lease to it); a plugin connector may add its own `extra` values. Everything else in kv_transfer_params is what a
prefill leg *returns* (who holds the KV, which blocks, the lease): a request that already
carries it is a decode leg sent to the wrong place, or a broken sender, and is refused naming the
field (ValueError -> INVALID_ARGUMENT) rather than being computed and its answer thrown away.
"""

from __future__ import annotations

import re

from pdcluster.engine.kv_connector import KVTransferParams

_TRANSFER_ID = re.compile(r"^[0-9a-f]{32}$")

# Set by the producer's connector when the prefill leg finishes (the decode leg's input).
PRODUCER_OUTPUT_FIELDS = (
    "request_id", "producer_id", "producer_rank", "producer_tp_size", "engine_epoch",
    "block_ids", "store_keys", "block_hashes", "num_tokens", "block_size", "remote_host", "remote_port",
    "handshake_endpoint", "producer_public_key", "lease_id", "lease_expiry_time", "transfer_token",
)


def check_producer_leg(kv: KVTransferParams) -> None:
    """Refuse a prefill leg that carries a field only the prefill leg's answer may hold."""
    if kv.transfer_id and not _TRANSFER_ID.match(kv.transfer_id):
        raise ValueError("kv_transfer_params.transfer_id: a router-assigned transfer id is 32 lowercase hex "
                         "characters")
    for name in PRODUCER_OUTPUT_FIELDS:
        if getattr(kv, name):  # unset: the default (0, "", b"", ()), which proto3 leaves off the wire
            raise ValueError(
                f"kv_transfer_params.{name}: not accepted on a prefill leg (do_remote_decode); it is "
                "part of what the prefill leg returns for the decode leg (send that one with "
                "do_remote_prefill to a decode worker)")
