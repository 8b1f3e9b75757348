"""Images through the router's preprocessing: OpenAI image_url parts -> ChatMessage.parts -> the
checkpoint's chat template as typed parts -> token ids with each image's placeholders expanded
(equal to LlavaProcessor's ids for the same text), images carried in prompt order; limits named."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from models.llava_tiny import IMAGE_TOKEN_ID, hf_processor, make_tiny_llava, random_image

from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.router.errors import RouterError
from pdcluster.router.openai_images import ImageLimits, load_image_placeholders
from pdcluster.router.openai_protocol import parse_chat
from pdcluster.router.preprocess import Preprocessor

# llava-hf/llava-1.5-7b-hf's chat template (its {% generation %} markers dropped): typed parts,
# images first, then the text.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def make_llava_with_template(path) -> str:
    ckpt = make_tiny_llava(path, seed=1)
    with open(f"{ckpt}/chat_template.jinja", "w") as f:
        f.write(LLAVA_TEMPLATE)
    return ckpt


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_llava_with_template(tmp_path_factory.mktemp("llava") / "ckpt")


def _pre(ckpt: str, limits: ImageLimits | None = None) -> Preprocessor:
    return Preprocessor(Tokenizer.from_pretrained(ckpt), served_model_names=["m"], max_model_len=512,
                        image_placeholders=load_image_placeholders(ckpt), image_limits=limits)


def test_placeholders_from_the_configs(ckpt: str, tmp_path) -> None:
    mm = load_image_placeholders(ckpt)
    assert mm is not None and mm.image_token_id == IMAGE_TOKEN_ID and mm.tokens_per_image == 16
    from pdcluster.models.demo import ensure_demo_model

    assert load_image_placeholders(str(ensure_demo_model(tmp_path / "demo"))) is None


def test_chat_with_images_tokenizes_like_llava_processor(ckpt: str) -> None:
    import transformers as tf

    a, b = png_bytes(random_image(3)), png_bytes(random_image(4, 50, 30))
    messages = [{"role": "system", "content": "t7"},
                {"role": "user", "content": [{"type": "text", "text": "t5 t6"},
                                             {"type": "image_url", "image_url": {"url": data_url(a)}},
                                             {"type": "image_url", "image_url": {"url": data_url(b)}}]}]
    req, _ = parse_chat({"messages": messages, "max_tokens": 4}, "m")
    prep = asyncio.run(_pre(ckpt).prepare(req, None))
    assert prep.images == [a, b]
    # transformers: the same template over typed parts, then LlavaProcessor expands and tokenizes
    hf_tok = tf.PreTrainedTokenizerFast(tokenizer_file=f"{ckpt}/tokenizer.json", unk_token="t0")
    typed = [{"role": "system", "content": [{"type": "text", "text": "t7"}]},
             {"role": "user", "content": [{"type": "text", "text": "t5 t6"}, {"type": "image"}, {"type": "image"}]}]
    text = hf_tok.apply_chat_template(typed, chat_template=LLAVA_TEMPLATE, tokenize=False, add_generation_prompt=True)
    ids = hf_processor(ckpt)(text=text, images=[random_image(3), random_image(4, 50, 30)])["input_ids"][0]
    assert prep.prompt_token_ids == list(ids)
    assert prep.prompt_token_ids.count(IMAGE_TOKEN_ID) == 32


def test_text_only_chat_on_a_multimodal_model(ckpt: str) -> None:
    req, _ = parse_chat({"messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 4}, "m")
    prep = asyncio.run(_pre(ckpt).prepare(req, None))
    tok = Tokenizer.from_pretrained(ckpt)
    assert prep.prompt_token_ids == tok.encode("USER: t5 t6 ASSISTANT:", add_special_tokens=False)
    assert prep.images == []


def test_limits_are_named(ckpt: str) -> None:
    img = {"type": "image_url", "image_url": {"url": data_url(png_bytes(random_image(3)))}}
    body = {"messages": [{"role": "user", "content": [img, img, img]}]}
    with pytest.raises(RouterError, match="max_images_per_request=2"):
        parse_chat(body, "m", ImageLimits(max_images_per_request=2))
    with pytest.raises(RouterError, match="max_image_bytes=100"):
        parse_chat(body, "m", ImageLimits(max_image_bytes=100))
    # the gRPC frontend's parts (bytes) meet the same limits in the Preprocessor
    req, _ = parse_chat(body, "m")
    with pytest.raises(RouterError, match="max_images_per_request=2"):
        asyncio.run(_pre(ckpt, ImageLimits(max_images_per_request=2)).prepare(req, None))
    with pytest.raises(RouterError, match="max_image_bytes=100"):
        asyncio.run(_pre(ckpt, ImageLimits(max_image_bytes=100)).prepare(req, None))
    with pytest.raises(RouterError, match="remote image URLs"):
        parse_chat({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}, "m")


def test_images_to_a_text_model_and_stray_image_tokens_are_refused(ckpt: str, tmp_path) -> None:
    from pdcluster.models.demo import ensure_demo_model

    demo = str(ensure_demo_model(tmp_path / "demo"))
    img = {"type": "image_url", "image_url": {"url": data_url(png_bytes(random_image(3)))}}
    req, _ = parse_chat({"messages": [{"role": "user", "content": [img]}]}, "m")
    text_pre = Preprocessor(Tokenizer.from_pretrained(demo), served_model_names=["m"])
    with pytest.raises(RouterError, match="takes no images"):
        asyncio.run(text_pre.prepare(req, None))
    # a literal <image> in the text: one image token more than images
    req, _ = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "<image>"}, img]}]}, "m")
    with pytest.raises(RouterError, match="placed 2 image tokens for 1 images"):
        asyncio.run(_pre(ckpt).prepare(req, None))
