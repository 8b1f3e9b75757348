"""Chained block hashes: the identity of a full KV block across processes and machines.

    block 0: h0 = H(None, tokens[0:bs],    extra)
    block 1: h1 = H(h0,   tokens[bs:2bs],  extra)      a block's hash names its whole prefix,
    block 2: h2 = H(h1,   tokens[2bs:3bs], extra)      so equal hashes mean equal KV

The engine's prefix cache, the router's prefix index and the KV store's keys all use these bytes,
so the encoding is a wire format: it never depends on the process (Python's `hash` is salted per
process) and any change to it must bump `_VERSION`. sha256 rather than a fast 64-bit hash because
a client who can forge a collision could make another tenant's request read the wrong KV.

Dependency-light on purpose (hashlib, struct, msgpack): the router imports this module.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import msgpack

# Domain tag and encoding version, hashed first: bytes from another scheme can never collide.
_VERSION = b"pdcluster.block_hash.v1\x00"
_MAX_TOKEN_ID = 0xFFFFFFFF
HASH_NBYTES = 32


def _encode_extra_keys(extra_keys: tuple | None) -> bytes:
    # None and () both mean "no extra keys"; a flag byte keeps the encoding prefix-free.
    if not extra_keys:
        return b"\x00"
    return b"\x01" + msgpack.packb(list(extra_keys), use_bin_type=True)


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> bytes:
    """sha256 over: version tag | len(parent) u32 | parent | len(tokens) u32 | tokens u32 LE | extras.

    Every variable-length part is length-prefixed so two different inputs never encode alike.
    extra_keys (e.g. a LoRA name, multimodal hashes, a cache salt) must be msgpack-encodable.
    """
    parent = parent_hash or b""
    n = len(token_ids)
    try:
        packed = struct.pack(f"<I{n}I", n, *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}]: {e}") from None
    h = hashlib.sha256(_VERSION)
    h.update(struct.pack("<I", len(parent)))
    h.update(parent)
    h.update(packed)
    h.update(_encode_extra_keys(extra_keys))
    return h.digest()


def salted(extra_keys: tuple | None, cache_salt: str | None) -> tuple | None:
    """The first block's extra keys with the request's cache salt. Salting block 0 alone is
    enough: every later hash chains on it. The salt is a [tag, salt] pair, which no multimodal
    key (a string) can equal; an unsalted block hashes as before."""
    if not cache_salt:
        return extra_keys
    return (*(extra_keys or ()), ("cache_salt", cache_salt))


def compute_block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes | None = None,
                         extra_keys: tuple | None = None, cache_salt: str | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of token_ids (a trailing partial block has no hash);
    cache_salt keys the first block (parent None), as the engine's prefix cache does."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = salted(extra_keys, cache_salt) if parent is None else extra_keys
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes


__all__ = ["HASH_NBYTES", "compute_block_hashes", "hash_block_tokens", "salted"]
