"""The store connector's per-step metadata: what every worker rank loads, saves and reports.

Plain data only (str, int, bytes, lists) so it can be broadcast to TP ranks as msgpack
(`to_dict` / `from_dict`); block hashes travel as their 32 raw bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcluster.engine.kv_connector import KVConnectorMetadata


@dataclass
class BlockSpec:
    """Blocks of one request: block_ids[i] holds the block whose chained hash is block_hashes[i]."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.block_hashes):
            raise ValueError(f"{self.req_id}: {len(self.block_ids)} block ids for {len(self.block_hashes)} hashes")


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
            return [[s.req_id, list(s.block_ids), list(s.block_hashes)] for s in xs]

        return {"loads": specs(self.loads), "saves": specs(self.saves), "finished": list(self.finished),
                "cancels": list(self.cancels)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoreConnectorMetadata:
        def specs(xs: Any) -> list[BlockSpec]:
            out = []
            for rid, ids, hashes in xs:
                if not isinstance(rid, str) or not all(isinstance(b, int) for b in ids) \
                        or not all(isinstance(h, bytes) for h in hashes):
                    raise ValueError("malformed store connector metadata")
                out.append(BlockSpec(rid, list(ids), list(hashes)))
            return out

        return cls(specs(d.get("loads", [])), specs(d.get("saves", [])), [str(r) for r in d.get("finished", [])],
                   [str(r) for r in d.get("cancels", [])])


__all__ = ["BlockSpec", "StoreConnectorMetadata"]
