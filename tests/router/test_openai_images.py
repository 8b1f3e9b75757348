"""OpenAI image_url content parts: data URLs checked and decoded, remote URLs refused, limits named."""

from __future__ import annotations

import base64
import io

import pytest

from pdcluster.router.errors import RouterError
from pdcluster.router.openai_images import ImageLimits, chat_parts, decode_image_url


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (10, 20, 30)).save(buf, format="JPEG")
    return buf.getvalue()


def _url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def test_data_urls_decode() -> None:
    png, jpeg = _png(), _jpeg()
    assert decode_image_url(_url(png), "x", ImageLimits()) == png
    assert decode_image_url(_url(jpeg, "jpeg"), "x", ImageLimits()) == jpeg
    assert decode_image_url(_url(jpeg, "JPG"), "x", ImageLimits()) == jpeg


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest", "https://example.com/cat.png", "HTTPS://x/y"])
def test_remote_urls_are_refused(url: str) -> None:
    with pytest.raises(RouterError, match="never fetches a URL") as e:
        decode_image_url(url, "messages[0].content[1].image_url", ImageLimits())
    assert e.value.field == "messages"


@pytest.mark.parametrize("url,match", [
    ("file:///etc/passwd", "must be a data:image/png"),
    ("data:text/plain;base64,aGk=", "must be a data:image/png"),
    ("data:image/gif;base64,R0lGOD", "image/gif is not supported"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not a PNG image"),
    (None, "must be a string"),
])
def test_bad_urls_are_named(url, match) -> None:
    with pytest.raises(RouterError, match=match):
        decode_image_url(url, "w", ImageLimits())


def test_size_limit_is_checked_before_decoding() -> None:
    limits = ImageLimits(max_image_bytes=100)
    with pytest.raises(RouterError, match="max_image_bytes=100"):
        decode_image_url("data:image/png;base64," + "A" * 4000, "w", limits)
    big = b"\x89PNG\r\n\x1a\n" + b"\0" * 200
    with pytest.raises(RouterError, match="max_image_bytes=100"):
        decode_image_url(_url(big), "w", limits)


def test_chat_parts_typed_for_the_template() -> None:
    png = _png()
    content = [{"type": "text", "text": "What is "}, {"type": "image_url", "image_url": {"url": _url(png)}},
               {"type": "text", "text": " this?"}]
    parts, images = chat_parts(content, 0, ImageLimits())
    assert parts == [{"type": "text", "text": "What is "}, {"type": "image"}, {"type": "text", "text": " this?"}]
    assert images == [png]


def test_chat_parts_limits_and_unknown_parts() -> None:
    part = {"type": "image_url", "image_url": {"url": _url(_png())}}
    with pytest.raises(RouterError, match="max_images_per_request=2"):
        chat_parts([part, part, part], 0, ImageLimits(max_images_per_request=2))
    with pytest.raises(RouterError, match="max_images_per_request=2"):
        chat_parts([part], 1, ImageLimits(max_images_per_request=2), num_images_so_far=2)
    with pytest.raises(RouterError, match="only 'text' and 'image_url'"):
        chat_parts([{"type": "input_audio"}], 0, ImageLimits())
    with pytest.raises(RouterError, match="must be an object"):
        chat_parts([{"type": "image_url", "image_url": "x"}], 0, ImageLimits())


def test_parse_chat_refuses_remote_urls_with_a_clear_400() -> None:
    from pdcluster.router.openai_protocol import parse_chat

    def body(url: str) -> dict:
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                          {"type": "image_url", "image_url": {"url": url}}]}]}

    with pytest.raises(RouterError, match=r"messages\[0\].content\[1\].image_url.url: remote image URLs") as e:
        parse_chat(body("https://example.com/a.png"), "m")
    assert e.value.field == "messages"
    req, _ = parse_chat(body(_url(_png())), "m")  # a data URL: carried to the workers as typed parts
    assert [p.WhichOneof("part") for p in req.chat.messages[0].parts] == ["text", "image"]
    assert req.chat.messages[0].parts[1].image == _png()
    parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "m")
