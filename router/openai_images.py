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
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any

from .errors import invalid

# declared MIME subtype -> magic bytes at the start of the file
_SIGNATURES = {"png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8\xff", "jpg": b"\xff\xd8\xff"}
_DATA_URL = re.compile(r"^data:image/([a-zA-Z]+);base64,", re.ASCII)


@dataclass(frozen=True)
class ImageLimits:
    max_images_per_request: int = 8
    max_image_bytes: int = 20 << 20


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
