"""The store connector's per-step metadata (what every worker rank loads, saves and reports) and
its part of the hand-off params (StoreHandoff).

Plain data only (str, int, bytes, lists) so it can be broadcast to TP ranks as msgpack
(`to_dict` / `from_dict`); block hashes travel as their 32 raw bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcluster.engine.kv_connector import ExtraValue, KVConnectorMetadata, KVTransferParams

PREFIX_KEY, LAST_HASH_KEY = "store_key_prefix", "store_last_hash"


@dataclass(frozen=True)
class StoreHandoff:
    """The store connector's entries of KVTransferParams.extra (strings, on the wire as before).
    The store finds blocks by hash, so a decode leg needs only: which key namespace the producer
    wrote under (key_prefix: model, dtype, layout, block size, store_tp_size) and the hex chained
    hash of the last block it promised (last_hash: the consumer checks it is its own prompt's).
    How many tokens are promised is the core field num_tokens."""

    key_prefix: str
    last_hash: str

    @classmethod
    def of(cls, params: KVTransferParams) -> StoreHandoff | None:
        """None when the params promise no block (no last_hash); a missing prefix reads as ""."""
        prefix, last = params.extra.get(PREFIX_KEY, ""), params.extra.get(LAST_HASH_KEY)
        if not isinstance(last, str):
            return None
        return cls(prefix if isinstance(prefix, str) else "", last)

    def into(self, extra: dict[str, ExtraValue]) -> dict[str, ExtraValue]:
        return {**extra, PREFIX_KEY: self.key_prefix, LAST_HASH_KEY: self.last_hash}


@dataclass
class BlockSpec:
    """Blocks of one request: block_ids[i] holds the block whose chained hash is block_hashes[i]."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.block_hashes):
            raise ValueError(f"{self.request_id}: {len(self.block_ids)} block ids for {len(self.block_hashes)} hashes")


@dataclass
class StoreConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockSpec] = field(default_factory=list)  # read into these blocks (async, across steps)
    saves: list[BlockSpec] = field(default_factory=list)  # full after this step's forward: write them
    # Requests that finished holding their blocks (delay_free): report each in finished_sending
    # once every save this rank started for it is done.
    finished: list[str] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # finished while loading: stop, then report

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.finished or self.cancels)

    def to_dict(self) -> dict[str, Any]:
        def specs(xs: list[BlockSpec]) -> list[list[Any]]:
            return [[s.request_id, list(s.block_ids), list(s.block_hashes)] for s in xs]

        return {"loads": specs(self.loads), "saves": specs(self.saves), "finished": list(self.finished),
                "cancels": list(self.cancels)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoreConnectorMetadata:
        def specs(xs: Any) -> list[BlockSpec]:
            out = []
            for request_id, ids, hashes in xs:
                if not isinstance(request_id, str) or not all(isinstance(b, int) for b in ids) \
                        or not all(isinstance(h, bytes) for h in hashes):
                    raise ValueError("malformed store connector metadata")
                out.append(BlockSpec(request_id, list(ids), list(hashes)))
            return out

        return cls(specs(d.get("loads", [])), specs(d.get("saves", [])), [str(r) for r in d.get("finished", [])],
                   [str(r) for r in d.get("cancels", [])])


__all__ = ["BlockSpec", "StoreConnectorMetadata", "StoreHandoff"]
