"""Block hashes are a wire format shared by engines, the router and the KV store: pin the encoding."""

from __future__ import annotations

import hashlib
import struct

import msgpack
import pytest

from pdcluster.engine.block_hash import HASH_NBYTES, compute_block_hashes, hash_block_tokens

# Known answers. If one changes, every stored key and router index entry changes with it: bump the
# version tag in block_hash.py on purpose, never by accident.
H_1234 = "854033af9960a9a01ff42eee09dc446597ac090ec06a1709d150f377ca785e2a"
H_5678_AFTER_1234 = "523b17d8312218df7024b3e263f0a525eaa79990cbca4b184b6fd6854a507701"
H_1234_EXTRA = "c141dc3216272e93de9cdb54c3a3ef8266114a247d5e753a5edcfb50f9f46be9"


def test_known_answer_vectors() -> None:
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0.hex() == H_1234
    assert hash_block_tokens(h0, [5, 6, 7, 8]).hex() == H_5678_AFTER_1234
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora-a", 7)).hex() == H_1234_EXTRA
    assert len(h0) == HASH_NBYTES


def test_encoding_is_the_documented_one() -> None:
    """Re-derive a hash from the documented layout, so another language can implement it."""
    parent = hash_block_tokens(None, [1, 2, 3, 4])
    tokens = [5, 70000, 0, 2**32 - 1]
    extra = ("salt", 3)
    h = hashlib.sha256(b"pdcluster.block_hash.v1\x00")
    h.update(struct.pack("<I", len(parent)) + parent)
    h.update(struct.pack("<5I", 4, *tokens))
    h.update(b"\x01" + msgpack.packb(["salt", 3], use_bin_type=True))
    assert hash_block_tokens(parent, tokens, extra) == h.digest()


def test_every_input_changes_the_hash() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(None, [2, 1, 3, 4]) != base
    assert hash_block_tokens(b"\x00" * 32, [1, 2, 3, 4]) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("x",)) != base
    # None and () both mean "no extra keys".
    assert hash_block_tokens(None, [1, 2, 3, 4], ()) == base
    # Length prefixes: moving a token across the parent/tokens boundary cannot collide.
    assert hash_block_tokens(b"\x01\x00\x00\x00", [2]) != hash_block_tokens(None, [1, 2])


def test_compute_block_hashes_chains_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes = compute_block_hashes(tokens, 4)
    assert len(hashes) == 2  # the partial third block has no hash
    assert hashes[0] == hash_block_tokens(None, tokens[0:4])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
    # A shared prefix gives shared leading hashes, whatever follows.
    assert compute_block_hashes(tokens[:8] + [99, 98, 97, 96], 4)[:2] == hashes
    assert compute_block_hashes(tokens, 4, extra_keys=("m",))[0] != hashes[0]
    assert compute_block_hashes([1, 2, 3], 4) == []


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5]])
def test_bad_token_ids_raise_value_error(bad: list) -> None:
    with pytest.raises(ValueError):
        hash_block_tokens(None, bad)


def test_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        compute_block_hashes([1, 2], 0)
