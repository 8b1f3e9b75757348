"""StoreLayout: how one KV block becomes store objects, so instances of any TP size share one pool.

Logical shards. A block's KV heads are cut into `store_tp_size` (S) shards of H/S consecutive
global heads each; every shard of every block is one immutable object:

    global KV heads   | h0 h1 | h2 h3 | h4 h5 | h6 h7 |      H = 8, S = 4, 2 heads per shard
    shards            |  s0   |  s1   |  s2   |  s3   |
    TP=1  rank 0      |  s0     s1      s2      s3   |      writes/reads all 4 shards
    TP=2  rank 0 | 1  |  s0     s1  |   s2      s3   |      S/t = 2 shards per rank
    TP=4  rank r      |  s_r  |                             1 shard per rank

With more ranks than KV heads (t > H) heads are replicated: S = H (one head per shard), rank r holds
head r*H//t, every rank holding a head reads its shard and only the first of them writes it.
S defaults to gcd(lcm(TP sizes sharing the store), H): the LCM so every TP size owns whole shards,
bounded by (and dividing) H.

Physical object, one per (block, shard), K and V kept separate (kernels/kv_pack.py buffers, B = 1):

    "LBHNC"  (2, L, h, N, C)   head-major: a head's N*C values are contiguous
    "LBNHC"  (2, L, N, h, C)   token-major: the paged cache's own order

Keys (pure ASCII, no process-dependent parts, so every instance names a block alike):

    {namespace}@{schema_fingerprint}@pp{r}@shard{s}/{S}@{chained_block_hash_hex}

The fingerprint covers model identity, KV and compute dtype, layers, heads, head dim, layout,
block size and S: instances that could disagree about a block's bytes never share a key.
Pure Python on purpose (no torch): the scheduler side and the router-side tools import it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

LAYOUTS = ("LBHNC", "LBNHC")
_SCHEMA_VERSION = 1
_FORBIDDEN = set("@/ \t\r\n")


@dataclass(frozen=True)
class ShardSlice:
    """One shard as a rank sees it: which local heads [local_h0, local_h1) it covers, and
    whether this rank writes it (False only for the non-first holders of a replicated head)."""

    shard: int
    local_h0: int
    local_h1: int
    writes: bool


def default_store_tp_size(tp_sizes: Iterable[int], total_num_kv_heads: int) -> int:
    """gcd(lcm(tp_sizes), H): every listed TP size owns whole shards, and shards split H evenly."""
    sizes = [int(t) for t in tp_sizes]
    if not sizes or any(t < 1 for t in sizes):
        raise ValueError(f"tp_sizes must be positive integers, got {sizes}")
    if total_num_kv_heads < 1:
        raise ValueError(f"total_num_kv_heads must be positive, got {total_num_kv_heads}")
    return math.gcd(math.lcm(*sizes), total_num_kv_heads)


@dataclass(frozen=True)
class StoreLayout:
    model_id: str  # identity of the weights (name or digest); different weights must differ here
    num_layers: int
    total_num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str  # the cache's dtype name, e.g. "bfloat16"
    itemsize: int  # bytes per element of kv_dtype
    store_tp_size: int
    layout: str = "LBHNC"
    compute_dtype: str = ""  # KV values depend on the dtype the model computes in, too
    namespace: str = "pdcluster"
    pp_rank: int = 0
    kv_scales: str = ""  # fp8 caches: digest of the checkpoint's k/v scales (kv_quant.kv_scales_digest)
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "total_num_kv_heads", "head_dim", "block_size", "itemsize", "store_tp_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"StoreLayout.{name} must be positive, got {getattr(self, name)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"StoreLayout.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.total_num_kv_heads % self.store_tp_size:
            raise ValueError(f"store_tp_size={self.store_tp_size} must divide the model's "
                             f"{self.total_num_kv_heads} KV heads")
        if not self.namespace or _FORBIDDEN & set(self.namespace) or not self.namespace.isascii():
            raise ValueError(f"store namespace must be non-empty ASCII without '@', '/' or spaces, "
                             f"got {self.namespace!r}")
        if self.pp_rank < 0:
            raise ValueError(f"pp_rank must be >= 0, got {self.pp_rank}")
        object.__setattr__(self, "fingerprint", self._fingerprint())

    def _fingerprint(self) -> str:
        facts = {"v": _SCHEMA_VERSION, "model": self.model_id, "layers": self.num_layers,
                 "kv_heads": self.total_num_kv_heads, "head_dim": self.head_dim, "block": self.block_size,
                 "kv_dtype": self.kv_dtype, "compute_dtype": self.compute_dtype, "layout": self.layout,
                 "store_tp": self.store_tp_size}
        if self.kv_scales:  # only fp8 layouts carry it: other layouts' keys are unchanged
            facts["kv_scales"] = self.kv_scales
        blob = json.dumps(facts, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # -- heads and shards ------------------------------------------------------------------------
    @property
    def heads_per_shard(self) -> int:
        return self.total_num_kv_heads // self.store_tp_size

    def shard_heads(self, shard: int) -> tuple[int, int]:
        """[start, end) of the global KV heads in `shard`."""
        if not 0 <= shard < self.store_tp_size:
            raise ValueError(f"shard {shard} outside [0, {self.store_tp_size})")
        hs = self.heads_per_shard
        return shard * hs, (shard + 1) * hs

    def check_tp(self, tp_size: int) -> None:
        """ValueError unless an instance with TP `tp_size` can write whole shards."""
        h, s = self.total_num_kv_heads, self.store_tp_size
        if tp_size <= h:
            if h % tp_size:
                raise ValueError(f"tensor_parallel_size={tp_size} does not divide the {h} KV heads")
            if s % tp_size:
                raise ValueError(f"store_tp_size={s} is not a multiple of tensor_parallel_size={tp_size}: a "
                                 f"rank would hold part of a shard (set store_tp_size to a multiple, e.g. "
                                 f"{default_store_tp_size([s, tp_size], h)}, on every instance)")
        else:
            if tp_size % h:
                raise ValueError(f"tensor_parallel_size={tp_size} > {h} KV heads must be a multiple of them")
            if s != h:
                raise ValueError(f"with replicated KV heads (tp {tp_size} > {h} heads) store_tp_size must be "
                                 f"{h} (one head per shard), got {s}")

    def rank_shards(self, tp_rank: int, tp_size: int) -> list[ShardSlice]:
        """The shards rank `tp_rank` of a TP-`tp_size` instance reads, in order, with the local head
        range each covers in that rank's cache and whether the rank writes it."""
        self.check_tp(tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
        h, s = self.total_num_kv_heads, self.store_tp_size
        if tp_size > h:  # replicated: one head, one shard; the first holder of the head writes
            per_head = tp_size // h
            return [ShardSlice(tp_rank // per_head, 0, 1, writes=tp_rank % per_head == 0)]
        per_rank = s // tp_size
        hs = self.heads_per_shard
        first = tp_rank * per_rank
        return [ShardSlice(first + j, j * hs, (j + 1) * hs, writes=True) for j in range(per_rank)]

    # -- bytes -----------------------------------------------------------------------------------
    def object_shape(self) -> tuple[int, ...]:
        """Logical shape of one (block, shard) object."""
        n, c, hs = self.block_size, self.head_dim, self.heads_per_shard
        if self.layout == "LBHNC":
            return (2, self.num_layers, hs, n, c)
        return (2, self.num_layers, n, hs, c)

    @property
    def object_nbytes(self) -> int:
        return math.prod(self.object_shape()) * self.itemsize

    # -- keys ------------------------------------------------------------------------------------
    @property
    def key_prefix(self) -> str:
        return f"{self.namespace}@{self.fingerprint}@pp{self.pp_rank}"

    def key(self, shard: int, block_hash: bytes) -> str:
        if not 0 <= shard < self.store_tp_size:
            raise ValueError(f"shard {shard} outside [0, {self.store_tp_size})")
        return f"{self.key_prefix}@shard{shard}/{self.store_tp_size}@{block_hash.hex()}"

    def block_keys(self, block_hash: bytes, shards: Sequence[int] | None = None) -> list[str]:
        """Keys of one block, for `shards` (default: all of them)."""
        return [self.key(s, block_hash) for s in (range(self.store_tp_size) if shards is None else shards)]

    def keys_for(self, block_hashes: Sequence[bytes]) -> list[str]:
        """All shards of every block, block-major: keys[i * S + s] is block i, shard s."""
        return [k for h in block_hashes for k in self.block_keys(h)]

    def blocks_present(self, block_hashes: Sequence[bytes], exists: Sequence[bool]) -> list[bool]:
        """Per block: every one of its S shards exists (exists is keys_for's order)."""
        s = self.store_tp_size
        if len(exists) != len(block_hashes) * s:
            raise ValueError(f"{len(exists)} exists flags for {len(block_hashes)} blocks of {s} shards")
        return [all(exists[i * s:(i + 1) * s]) for i in range(len(block_hashes))]


__all__ = ["LAYOUTS", "ShardSlice", "StoreLayout", "default_store_tp_size"]
