"""LLaVA in the engine: chunked prefill through an image, the encoder cache, and prefix caching
keyed by the images (two prompts with the same text and different images never share KV)."""

from __future__ import annotations

import pytest
from models.llava_tiny import hf_greedy, make_tiny_llava, random_image

from pdcluster import LLM, SamplingParams
from pdcluster.engine.block_hash import hash_block_tokens

MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava(tmp_path_factory.mktemp("llava") / "ckpt", seed=1)


def _gen(llm: LLM, prompt: str, images: list) -> tuple[list[int], int]:
    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": images}}], GREEDY)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_chunked_prefill_through_an_image(llava_path: str) -> None:
    # 5-token chunks: the 16 placeholders of each image are split over 4 steps, mid-image each time.
    llm = LLM(llava_path, num_kv_blocks=64, block_size=4, max_num_batched_tokens=5, max_num_seqs=4)
    try:
        images = [random_image(1), random_image(2, 50, 30)]
        prompt = "t3 t4 <image> t5 <image> t6"
        ours, _ = _gen(llm, prompt, images)
        assert ours == hf_greedy(llava_path, prompt, images, MAX_NEW)
        # each image was encoded once although its placeholders were consumed over several steps
        assert llm.engine.core.runner.mm.encoder_cache.stats.num_encoded == 2
    finally:
        llm.shutdown()


def test_repeated_image_hits_the_encoder_cache(llava_path: str) -> None:
    llm = LLM(llava_path, num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    try:
        stats = llm.engine.core.runner.mm.encoder_cache.stats
        image = random_image(7)
        first, _ = _gen(llm, "t1 <image> t2", [image])
        assert stats.num_encoded == 1
        # the same image again (another PIL object, other text around it): the tower does not run
        second, _ = _gen(llm, "t9 t8 <image> t2", [random_image(7)])
        assert stats.num_encoded == 1 and stats.hits >= 1
        assert second == hf_greedy(llava_path, "t9 t8 <image> t2", [image], MAX_NEW)
        # twice in one prompt: one encoding as well
        _gen(llm, "<image> t1 <image>", [image, image])
        assert stats.num_encoded == 1
        _gen(llm, "t1 <image>", [random_image(8)])
        assert stats.num_encoded == 2
    finally:
        llm.shutdown()


def test_encoder_cache_is_bounded(llava_path: str) -> None:
    # one encoder output is 16 x 64 float32 = 4096 bytes; room for two
    llm = LLM(llava_path, num_kv_blocks=64, encoder_cache_bytes=2 * 4096, enable_prefix_caching=False)
    try:
        cache = llm.engine.core.runner.mm.encoder_cache
        for seed in (1, 2, 3):
            _gen(llm, "t1 <image>", [random_image(seed)])
        assert len(cache) == 2 and cache.nbytes == 8192 and cache.stats.evictions == 1
        _gen(llm, "t1 <image>", [random_image(1)])  # evicted: encoded again
        assert cache.stats.num_encoded == 4
    finally:
        llm.shutdown()


def test_same_text_different_images_never_share_kv(llava_path: str) -> None:
    llm = LLM(llava_path, num_kv_blocks=64, block_size=4)
    try:
        prompt = "t1 t2 t3 t4 <image> t5 t6 t7 t8 t9"
        a, b = random_image(1), random_image(2)
        out_a, _ = _gen(llm, prompt, [a])
        out_b, cached_b = _gen(llm, prompt, [b])
        # only the text block before the image is shared (4 tokens)
        assert cached_b == 4
        assert out_b == hf_greedy(llava_path, prompt, [b], MAX_NEW)
        assert out_a == hf_greedy(llava_path, prompt, [a], MAX_NEW)
        again_a, cached_a = _gen(llm, prompt, [random_image(1)])
        assert again_a == out_a
        assert cached_a == 24  # every full block: the same image is the same KV
        req_a, _ = llm.engine.prepare_request(prompt, GREEDY, multi_modal_data={"image": [a]})
        req_b, _ = llm.engine.prepare_request(prompt, GREEDY, multi_modal_data={"image": [b]})
        assert req_a.prompt_token_ids == req_b.prompt_token_ids
        llm.engine.core.scheduler.kv.update_block_hashes(req_a)
        llm.engine.core.scheduler.kv.update_block_hashes(req_b)
        assert req_a.block_hashes[0] == req_b.block_hashes[0]
        assert all(x != y for x, y in zip(req_a.block_hashes[1:], req_b.block_hashes[1:]))
        # a block covering placeholders carries the image's mm_hash as an extra key
        ids = req_a.prompt_token_ids
        assert req_a.block_hashes[1] == hash_block_tokens(req_a.block_hashes[0], ids[4:8],
                                                          (req_a.mm_features[0].mm_hash,))
    finally:
        llm.shutdown()


def test_prefix_hit_ending_inside_an_image(llava_path: str) -> None:
    # block_size 4 and an image starting at offset 2: the cached prefix ends mid-image, so the rest
    # of the image's placeholders take a slice of the encoder output.
    llm = LLM(llava_path, num_kv_blocks=64, block_size=4)
    try:
        image = random_image(3)
        base = "t1 t2 <image>"
        _gen(llm, base, [image])
        longer = "t1 t2 <image> t3 t4 t5"
        out, cached = _gen(llm, longer, [image])
        assert cached == 16  # 18 tokens of the first prompt -> 4 full blocks
        assert out == hf_greedy(llava_path, longer, [image], MAX_NEW)
    finally:
        llm.shutdown()


def test_async_engine_takes_images_and_counts_them(llava_path: str) -> None:
    import asyncio

    from pdcluster.config import EngineArgs
    from pdcluster.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_engine_args(EngineArgs(model=llava_path, num_kv_blocks=64, block_size=4))
    try:
        image = random_image(9, 40, 48)

        async def run(rid: str, prompt: str) -> list[int]:
            toks: list[int] = []
            async for out in engine.generate(prompt, GREEDY, request_id=rid,
                                             multi_modal_data={"image": image}):
                toks += out.outputs[0].token_ids
            return toks

        assert asyncio.run(run("a", "t4 <image> t5")) == hf_greedy(llava_path, "t4 <image> t5", [image], MAX_NEW)
        # other text first: no prefix hit, but the image's encoding comes from the encoder cache
        assert asyncio.run(run("b", "t6 <image> t5")) == hf_greedy(llava_path, "t6 <image> t5", [image], MAX_NEW)
        stats = engine.engine.get_stats()
        assert stats["mm_items_computed"] == 1 and stats["mm_items_local_cache"] == 1
        assert stats["encoder_cache_entries"] == 1 and stats["encoder_cache_bytes"] == 16 * 64 * 4
    finally:
        engine.shutdown()
