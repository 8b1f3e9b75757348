"""LLaVA token-exact vs transformers' greedy generate on tiny random checkpoints (float32), the
image preprocessing vs transformers' CLIP image processor, and the offline API's limits."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from models.llava_tiny import IMAGE_SIZE, hf_greedy, hf_processor, make_tiny_llava, random_image

from pdcluster import LLM, SamplingParams
from pdcluster.models.image_processor import ImageProcessor

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava(tmp_path_factory.mktemp("llava") / "ckpt")


@pytest.fixture(scope="module")
def llm(llava_path: str) -> LLM:
    engine = LLM(llava_path, num_kv_blocks=128, block_size=4)
    yield engine
    engine.shutdown()


def _ours(llm: LLM, prompt: str, images: list) -> list[int]:
    item = {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
    return llm.generate([item], GREEDY)[0].outputs[0].token_ids


@pytest.mark.parametrize("size,mode", [((IMAGE_SIZE, IMAGE_SIZE), "RGB"), ((50, 41), "RGB"), ((23, 70), "RGBA"),
                                       ((12, 12), "L")])
def test_pixel_values_equal_transformers(llava_path: str, size: tuple[int, int], mode: str) -> None:
    image = random_image(7, *size, mode=mode)
    ref = hf_processor(llava_path).image_processor(image, return_tensors="np")["pixel_values"][0]
    ours = ImageProcessor.from_pretrained(llava_path).preprocess(image)
    assert ours.shape == ref.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)


def test_placeholder_expansion_matches_processor(llm: LLM, llava_path: str) -> None:
    images = [random_image(1), random_image(2, 40, 60)]
    prompt = "t3 <image> t4 t5 <image> t6"
    ref_ids = hf_processor(llava_path)(text=prompt, images=images, return_tensors="pt")["input_ids"][0].tolist()
    req, _ = llm.engine.prepare_request(prompt, GREEDY, multi_modal_data={"image": images})
    assert req.prompt_token_ids == ref_ids
    assert [(f.offset, f.length) for f in req.mm_features] == [(1, 16), (19, 16)]


def test_one_image_token_exact(llm: LLM, llava_path: str) -> None:
    image = random_image(11)
    prompt = "t5 t9 <image> t7 t8"
    ours = _ours(llm, prompt, [image])
    assert ours == hf_greedy(llava_path, prompt, [image], MAX_NEW)
    # the image matters: another one changes the continuation
    assert _ours(llm, prompt, [random_image(12)]) == hf_greedy(llava_path, prompt, [random_image(12)], MAX_NEW)


def test_two_images_per_prompt_token_exact(llm: LLM, llava_path: str) -> None:
    images = [random_image(21), random_image(22)]
    prompt = "t1 <image> t2 t3 <image> t4"
    assert _ours(llm, prompt, images) == hf_greedy(llava_path, prompt, images, MAX_NEW)


def test_image_of_another_size_token_exact(llm: LLM, llava_path: str) -> None:
    images = [random_image(31, 57, 33), random_image(32, 20, 90, mode="RGBA")]
    prompt = "<image> t2 <image> t6 t7"
    assert _ours(llm, prompt, images) == hf_greedy(llava_path, prompt, images, MAX_NEW)


def test_text_only_prompt_on_llava(llm: LLM, llava_path: str) -> None:
    prompt = "t10 t11 t12 t13 t14"
    assert _ours(llm, prompt, []) == hf_greedy(llava_path, prompt, [], MAX_NEW)


def test_batch_of_mixed_prompts(llm: LLM, llava_path: str) -> None:
    items = [("t5 <image> t6", [random_image(41)]), ("t7 t8 t9", []), ("<image> t1 <image>", [random_image(42),
                                                                                              random_image(41)])]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": ims}} if ims else p for p, ims in items], GREEDY)
    for (prompt, images), out in zip(items, outs):
        assert out.outputs[0].token_ids == hf_greedy(llava_path, prompt, images, MAX_NEW)
        assert out.prompt == prompt


@pytest.mark.parametrize("feature_layer,strategy", [(-1, "full"), ([-3, -1], "default"), (1, "default")])
def test_feature_layer_and_strategy(tmp_path, feature_layer, strategy) -> None:
    path = make_tiny_llava(tmp_path / "ckpt", seed=3, vision_feature_layer=feature_layer,
                           vision_feature_select_strategy=strategy)
    engine = LLM(path, num_kv_blocks=64)
    try:
        image = random_image(5, 44, 36)
        prompt = "t2 <image> t3"
        assert _ours(engine, prompt, [image]) == hf_greedy(path, prompt, [image], MAX_NEW)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("vision_act,projector_act", [("gelu_new", "silu"), ("gelu", "gelu_pytorch_tanh"),
                                                     ("quick_gelu", "relu"), ("gelu_pytorch_tanh", "gelu_new")])
def test_activations(tmp_path, vision_act, projector_act) -> None:
    """Every transformers activation name the tower or the projector may carry, computed as it does."""
    path = make_tiny_llava(tmp_path / "ckpt", seed=8, vision_hidden_act=vision_act, projector_hidden_act=projector_act)
    engine = LLM(path, num_kv_blocks=64)
    try:
        image = random_image(9, 40, 29)
        assert _ours(engine, "t3 <image> t8", [image]) == hf_greedy(path, "t3 <image> t8", [image], MAX_NEW)
    finally:
        engine.shutdown()


def test_unknown_activation_is_refused_by_name(tmp_path) -> None:
    path = make_tiny_llava(tmp_path / "ckpt", projector_hidden_act="mish")
    with pytest.raises(ValueError, match="projector_hidden_act 'mish' is not supported"):
        LLM(path, num_kv_blocks=64)


def test_the_async_engine_preprocesses_images_off_the_event_loop(llava_path: str, monkeypatch) -> None:
    """Decoding and preprocessing images (a 4096x4096 JPEG: ~0.35 s) runs on a worker thread, so a
    worker's event loop, its health checks and its other streams are not held up."""
    import asyncio
    import threading

    from pdcluster.config import EngineArgs
    from pdcluster.engine.async_engine import AsyncEngine
    from pdcluster.engine.llm_engine import LLMEngine

    engine = AsyncEngine(lambda: LLMEngine.from_engine_args(EngineArgs(model=llava_path, num_kv_blocks=64)))
    threads: list[threading.Thread] = []
    mm = engine.engine.mm_processor
    preprocess = mm.preprocess
    monkeypatch.setattr(mm, "preprocess", lambda *a: (threads.append(threading.current_thread()), preprocess(*a))[1])
    image = random_image(4)

    async def run() -> tuple[threading.Thread, list[int]]:
        outs = [o async for o in engine.generate("t2 <image> t3", GREEDY, multi_modal_data={"image": [image]})]
        return threading.current_thread(), [t for o in outs for t in o.outputs[0].token_ids]

    try:
        loop_thread, tokens = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(threads) == 1 and threads[0] is not loop_thread
    assert tokens == hf_greedy(llava_path, "t2 <image> t3", [image], MAX_NEW)


def test_qwen2_decoder(tmp_path) -> None:
    path = make_tiny_llava(tmp_path / "ckpt", seed=4, text_model_type="qwen2")
    engine = LLM(path, num_kv_blocks=64)
    try:
        image = random_image(6)
        assert _ours(engine, "t4 <image> t5", [image]) == hf_greedy(path, "t4 <image> t5", [image], MAX_NEW)
    finally:
        engine.shutdown()


def test_limits_are_named(llava_path: str) -> None:
    engine = LLM(llava_path, num_kv_blocks=32, max_images_per_request=1, max_image_pixels=40 * 40,
                 max_image_bytes=64)
    try:
        prep = engine.engine.prepare_request
        with pytest.raises(ValueError, match="max_images_per_request"):
            prep("<image> <image>", GREEDY, multi_modal_data={"image": [random_image(1), random_image(2)]})
        with pytest.raises(ValueError, match="max_image_pixels"):
            prep("<image>", GREEDY, multi_modal_data={"image": random_image(1, 41, 40)})
        buf = io.BytesIO()
        random_image(1).save(buf, format="PNG")
        with pytest.raises(ValueError, match="max_image_bytes"):
            prep("<image>", GREEDY, multi_modal_data={"image": buf.getvalue()})
        with pytest.raises(ValueError, match="placeholders for 1 images"):
            prep("t1 t2", GREEDY, multi_modal_data={"image": random_image(1)})
        with pytest.raises(ValueError, match="unsupported modality"):
            prep("<image>", GREEDY, multi_modal_data={"video": random_image(1)})
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="max_images_per_request"):
        LLM(llava_path, max_images_per_request=0)


def test_encoded_image_bytes_are_accepted(llm: LLM, llava_path: str) -> None:
    image = random_image(51)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    from_bytes = llm.generate([{"prompt": "t8 <image>", "multi_modal_data": {"image": buf.getvalue()}}], GREEDY)
    assert from_bytes[0].outputs[0].token_ids == _ours(llm, "t8 <image>", [image])


def test_text_model_refuses_images(tmp_path) -> None:
    from tiny_models import make_tiny_checkpoint

    engine = LLM(make_tiny_checkpoint("llama", tmp_path / "l"), num_kv_blocks=16)
    try:
        with pytest.raises(ValueError, match="takes no images"):
            engine.generate([{"prompt": "t1 <image>", "multi_modal_data": {"image": random_image(1)}}], GREEDY)
    finally:
        engine.shutdown()


def test_tensor_parallel_is_refused(llava_path: str) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=1 only"):
        LLM(llava_path, tensor_parallel_size=2)


def test_encoder_output_matches_transformers(llava_path: str) -> None:
    import transformers as tf

    from pdcluster.engine.model_runner import make_attention_backend
    from pdcluster.models.hf_config import load_model_config
    from pdcluster.models.loader import load_model

    pixels = hf_processor(llava_path).image_processor([random_image(1), random_image(2)],
                                                      return_tensors="pt")["pixel_values"]
    ref_model = tf.LlavaForConditionalGeneration.from_pretrained(llava_path, dtype=torch.float32).eval()
    ours = load_model(load_model_config(llava_path), make_attention_backend("torch"))
    with torch.no_grad():
        ref = torch.stack(ref_model.model.get_image_features(
            pixels, vision_feature_layer=-2, vision_feature_select_strategy="default").pooler_output)
        got = ours.encode_images(pixels)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_token_id_prompt_with_expanded_placeholders(llm: LLM, llava_path: str) -> None:
    images = [random_image(61), random_image(62, 45, 32)]
    prompt = "t2 <image> t3 <image>"
    ids = hf_processor(llava_path)(text=prompt, images=images, return_tensors="pt")["input_ids"][0].tolist()
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], GREEDY)[0]
    assert out.outputs[0].token_ids == _ours(llm, prompt, images)
    with pytest.raises(ValueError, match="image placeholder tokens"):
        llm.generate([{"prompt_token_ids": ids[:-3], "multi_modal_data": {"image": images}}], GREEDY)
