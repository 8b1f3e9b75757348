"""Byte ranges of KV blocks inside a rank's one registered cache buffer.

The cache is one contiguous (L, 2, num_blocks, block_size, Hk, D) tensor (NHD), so each
(layer, k|v, block) is one contiguous run of `block_nbytes` bytes:

    offset(l, kv, b) = ((l * 2 + kv) * num_blocks + b) * block_nbytes

A transfer of blocks [b0, b1, ...] is the concatenation, in this order, of

    for l in layers: for kv in (K, V): for b in block_ids: bytes of (l, kv, b)

Producer and consumer cut that same byte stream into ranges of their own buffers (consecutive
block ids merge into one range), so the producer's range list (which its token covers) and the
consumer's destination ranges differ in segmentation but never in order or total size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A token covers at most this many ranges (the TransferServer refuses more than 16384).
MAX_RANGES_PER_CHUNK = 8192


@dataclass(frozen=True)
class CacheGeometry:
    num_layers: int
    num_blocks: int
    block_nbytes: int  # one block of K (or V) of one layer

    @property
    def nbytes(self) -> int:
        return self.num_layers * 2 * self.num_blocks * self.block_nbytes

    def offset(self, layer: int, kv: int, block: int) -> int:
        return ((layer * 2 + kv) * self.num_blocks + block) * self.block_nbytes


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first id, count) of each run of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def block_ranges(geo: CacheGeometry, block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(offset, length) ranges of the blocks' bytes, in transfer order."""
    for b in block_ids:
        if not 0 <= b < geo.num_blocks:
            raise ValueError(f"block id {b} outside [0, {geo.num_blocks})")
    runs = _runs(block_ids)
    return [(geo.offset(layer, kv, first), count * geo.block_nbytes)
            for layer in range(geo.num_layers) for kv in (0, 1) for first, count in runs]


def chunk_block_ids(block_ids: Sequence[int], num_layers: int,
                    max_ranges: int = MAX_RANGES_PER_CHUNK) -> list[list[int]]:
    """Split a block list so that no chunk has more than max_ranges ranges (each block adds at
    most 2 * num_layers). Deterministic: producer and consumer cut the same way."""
    per_chunk = max(1, max_ranges // (2 * num_layers))
    return [list(block_ids[i:i + per_chunk]) for i in range(0, len(block_ids), per_chunk)] or [[]]


def paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src first, dst first, count) runs where both lists are consecutive: one memcpy per layer,
    K/V and run for a same-host copy."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(src_geo: CacheGeometry, src: memoryview, dst_geo: CacheGeometry, dst: memoryview,
                src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
    """Copy blocks between two caches of equal block_nbytes (same host, shared memory). Returns bytes."""
    if src_geo.block_nbytes != dst_geo.block_nbytes or src_geo.num_layers != dst_geo.num_layers:
        raise ValueError("source and destination caches have different block geometry")
    for b in src_ids:
        if not 0 <= b < src_geo.num_blocks:
            raise ValueError(f"source block id {b} outside [0, {src_geo.num_blocks})")
    for b in dst_ids:
        if not 0 <= b < dst_geo.num_blocks:
            raise ValueError(f"destination block id {b} outside [0, {dst_geo.num_blocks})")
    total = 0
    runs = paired_runs(src_ids, dst_ids)
    for layer in range(src_geo.num_layers):
        for kv in (0, 1):
            for s, d, count in runs:
                n = count * src_geo.block_nbytes
                so, do = src_geo.offset(layer, kv, s), dst_geo.offset(layer, kv, d)
                dst[do:do + n] = src[so:so + n]  # memcpy
                total += n
    return total
