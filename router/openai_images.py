"""OpenAI chat `image_url` content parts: checked and decoded in the router, never fetched.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,...."}}   accepted (png, jpeg)
    {"type": "image_url", "image_url": {"url": "https://..."}}                 400: refused

The server never fetches a URL taken from request data (that would let any client make it reach
internal addresses), so only inline `data:` URLs are accepted. Sizes are checked before decoding
(the base64 text's length bounds the bytes), the base64 strictly, and the bytes must start with
the declared format's signature. Pixels are not decoded here (the engine does it, with its own
pixel limit): the router stays cheap and imports neither PIL nor torch.

`chat_parts` returns the message content as transformers' processors give it to a chat template:
a list of typed parts, `{"type": "text", "text": ...}` and `{"type": "image"}` in order, plus
the image bytes in the same order.

`ImagePlaceholders` is what the router needs to tokenize such a prompt as the engine would: the
checkpoint's image token and how many placeholders one image becomes, read torch-free from
config.json and preprocessor_config.json (LLaVA: every image is resized and center-cropped to
crop_size, so the count is fixed). The router expands each image token in the token ids (as
LlavaProcessor does in the text: the image token is a special token, so both give the same ids)
and sends the expanded ids, so prefix-aware routing and length checks see the real prompt; the
worker only decodes and preprocesses the bytes.
"""

from __future__ import annotations

import base64
import binascii
import json
import pathlib
import re
from dataclasses import dataclass
from typing import Any

from .errors import invalid

# declared MIME subtype -> magic bytes at the start of the file
_SIGNATURES = {"png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8\xff", "jpg": b"\xff\xd8\xff"}
_DATA_URL = re.compile(r"^data:image/([a-zA-Z]+);base64,", re.ASCII)
# A chat template that reads typed parts (`content['type']`, `selectattr('type', ...)`) wants every
# message's content as a list of parts, text-only ones included (vLLM's "openai" content format).
_TYPED_TEMPLATE = re.compile(r"""\[\s*['"]type['"]\s*\]|\.type\b|selectattr\(\s*['"]type['"]""")


@dataclass(frozen=True)
class ImageLimits:
    max_images_per_request: int = 8
    max_image_bytes: int = 20 << 20


@dataclass(frozen=True)
class ImagePlaceholders:
    image_token_id: int
    tokens_per_image: int


def load_image_placeholders(model_path: str) -> ImagePlaceholders | None:
    """A LLaVA checkpoint's image token and placeholders per image; None for a text-only model.
    ValueError when the count depends on the image (no center crop to a fixed size)."""
    from pdcluster.models.llava_config import is_llava, load_llava_vision_config

    root = pathlib.Path(model_path)
    cfg = root / "config.json"
    if not cfg.is_file() or not is_llava(json.loads(cfg.read_text(encoding="utf-8"))):
        return None
    vision = load_llava_vision_config(root)
    pre = _preprocessor_config(root)
    size = pre.get("crop_size", {"height": 224, "width": 224}) if pre.get("do_center_crop", True) else pre.get("size")
    if isinstance(size, int):
        size = {"height": size, "width": size}
    if not isinstance(size, dict) or "height" not in size or "width" not in size:
        raise ValueError(f"{model_path}: the image size after preprocessing depends on the image "
                         "(no center crop to a fixed size); the router cannot count its placeholders")
    return ImagePlaceholders(vision.image_token_index, vision.num_image_tokens(int(size["height"]), int(size["width"])))


def _preprocessor_config(root: pathlib.Path) -> dict[str, Any]:
    for name in ("preprocessor_config.json", "processor_config.json"):
        f = root / name
        if f.is_file():
            data = json.loads(f.read_text(encoding="utf-8"))
            return data.get("image_processor", data)
    return {}


def wants_typed_parts(template: str | None) -> bool:
    return bool(template) and _TYPED_TEMPLATE.search(template or "") is not None


def expand_placeholders(ids: list[int], num_images: int, mm: ImagePlaceholders) -> list[int]:
    """Each image token of the rendered prompt -> tokens_per_image copies; 400 if the template
    did not place exactly one image token per image."""
    found = sum(1 for t in ids if t == mm.image_token_id)
    if found != num_images:
        raise invalid("messages", f"the chat template placed {found} image tokens for {num_images} images "
                                  "(does this model's chat template take image parts?)")
    if not num_images:
        return ids
    out: list[int] = []
    for t in ids:
        if t == mm.image_token_id:
            out.extend([t] * mm.tokens_per_image)
        else:
            out.append(t)
    return out


def check_image_bytes(images: list[bytes], limits: ImageLimits) -> None:
    """The limits for images that arrived as bytes (the router's gRPC ChatMessage.parts)."""
    if len(images) > limits.max_images_per_request:
        raise invalid("messages", f"{len(images)} images in the request; max_images_per_request="
                                  f"{limits.max_images_per_request}")
    for k, data in enumerate(images):
        if len(data) > limits.max_image_bytes:
            raise invalid("messages", f"image {k} is {len(data)} bytes; max_image_bytes={limits.max_image_bytes}")
        if not any(data.startswith(sig) for sig in _SIGNATURES.values()):
            raise invalid("messages", f"image {k}: the bytes are not a PNG or JPEG image")


def decode_image_url(url: Any, where: str, limits: ImageLimits) -> bytes:
    """An image_url's `url` -> the image bytes, or a 400 naming `where` and the rule broken."""
    if not isinstance(url, str):
        raise invalid("messages", f"{where}.url must be a string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise invalid("messages", f"{where}.url: remote image URLs (http/https) are refused: the server never "
                                  "fetches a URL taken from request data; send the image inline as "
                                  "data:image/png;base64,... or data:image/jpeg;base64,...")
    m = _DATA_URL.match(url)
    if m is None:
        raise invalid("messages", f"{where}.url must be a data:image/png;base64,... or "
                                  "data:image/jpeg;base64,... URL")
    kind = m.group(1).lower()
    if kind not in _SIGNATURES:
        raise invalid("messages", f"{where}.url: image/{kind} is not supported; supported: image/png, image/jpeg")
    payload = url[m.end():]
    if (len(payload) // 4) * 3 > limits.max_image_bytes + 2:  # checked before decoding anything
        raise invalid("messages", f"{where}: the image is over max_image_bytes={limits.max_image_bytes}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid("messages", f"{where}.url: the data URL is not valid base64") from None
    if len(data) > limits.max_image_bytes:
        raise invalid("messages", f"{where}: the image is {len(data)} bytes; max_image_bytes={limits.max_image_bytes}")
    if not data.startswith(_SIGNATURES[kind]):
        raise invalid("messages", f"{where}.url: the bytes are not a {kind.upper()} image")
    return data


def chat_parts(content: list[Any], i: int, limits: ImageLimits, num_images_so_far: int = 0, start: int = 0
               ) -> tuple[list[dict[str, str]], list[bytes]]:
    """A message's list content -> (typed parts for the chat template, image bytes in order);
    `start`: the index of content[0] within the message (for the error messages)."""
    parts: list[dict[str, str]] = []
    images: list[bytes] = []
    for j, part in enumerate(content, start):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            image_url = part.get("image_url")
            if not isinstance(image_url, dict):
                raise invalid("messages", f"{where}.image_url must be an object with a 'url'")
            if num_images_so_far + len(images) + 1 > limits.max_images_per_request:
                raise invalid("messages", f"{where}: more than max_images_per_request="
                                          f"{limits.max_images_per_request} images in the request")
            images.append(decode_image_url(image_url.get("url"), f"{where}.image_url", limits))
            parts.append({"type": "image"})
        else:
            raise invalid("messages", f"{where}: only 'text' and 'image_url' parts are supported")
    return parts, images
