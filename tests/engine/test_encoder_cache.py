"""EncoderCache (LRU bounded in bytes) and the multimodal block-hash keys, without a model."""

from __future__ import annotations

import numpy as np
import pytest

from pdcluster.engine.block_hash import hash_block_tokens
from pdcluster.engine.encoder_cache import EncoderCache
from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.mm_inputs import MultiModalFeature, block_extra_keys, mm_hash
from pdcluster.engine.request import Request
from pdcluster.sampling_params import SamplingParams


def test_lru_bounded_in_bytes() -> None:
    cache = EncoderCache(max_bytes=100)
    cache.put("a", "A", 40)
    cache.put("b", "B", 40)
    assert cache.get("a") == "A"  # a is now the most recent
    cache.put("c", "C", 40)  # evicts b, the least recently used
    assert "b" not in cache and cache.get("a") == "A" and cache.get("c") == "C"
    assert cache.nbytes == 80 and cache.stats.evictions == 1
    assert cache.get("b") is None and cache.stats.misses == 1 and cache.stats.hits == 3


def test_oversized_entry_is_not_cached_and_zero_disables() -> None:
    cache = EncoderCache(max_bytes=10)
    cache.put("big", "X", 11)
    assert len(cache) == 0
    off = EncoderCache(0)
    off.put("a", "A", 1)
    assert off.get("a") is None
    with pytest.raises(ValueError):
        EncoderCache(-1)


def test_put_existing_key_keeps_one_entry() -> None:
    cache = EncoderCache(max_bytes=100)
    cache.put("a", "A", 30)
    cache.put("a", "A2", 30)
    assert len(cache) == 1 and cache.nbytes == 30


def test_mm_hash_depends_on_pixels_shape_and_encoder() -> None:
    px = np.zeros((3, 4, 4), np.float32)
    other = px.copy()
    other[0, 0, 0] = 1e-7
    assert mm_hash(px, "enc") == mm_hash(px.copy(), "enc")
    assert mm_hash(px, "enc") != mm_hash(other, "enc")
    assert mm_hash(px, "enc") != mm_hash(px, "enc2")
    assert mm_hash(px, "enc") != mm_hash(px.reshape(3, 2, 8), "enc")


def test_block_extra_keys_cover_overlapping_images() -> None:
    f1 = MultiModalFeature("h1", offset=2, length=5, pixel_values=None)  # tokens 2..6
    f2 = MultiModalFeature("h2", offset=9, length=3, pixel_values=None)  # tokens 9..11
    assert block_extra_keys([f1, f2], 0, 2) is None
    assert block_extra_keys([f1, f2], 0, 4) == ("h1",)
    assert block_extra_keys([f1, f2], 4, 8) == ("h1",)
    assert block_extra_keys([f1, f2], 4, 12) == ("h1", "h2")
    assert block_extra_keys([f1, f2], 7, 9) is None


def test_kv_cache_manager_hashes_images_into_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True, max_model_len=64)
    tokens = [5, 6, 9, 9, 9, 9, 7, 8]
    feats = [MultiModalFeature("img-a", 2, 4, None)]
    req = Request("r", tokens, SamplingParams(), mm_features=feats)
    plain = Request("p", tokens, SamplingParams())
    kv.update_block_hashes(req)
    kv.update_block_hashes(plain)
    assert req.block_hashes[0] == hash_block_tokens(None, tokens[:4], ("img-a",))
    assert req.block_hashes[0] != plain.block_hashes[0]
    assert req.block_hashes[1] != plain.block_hashes[1]  # chained through the parent
