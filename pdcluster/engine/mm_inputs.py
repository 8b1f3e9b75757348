"""Multimodal request inputs: images -> preprocessed pixels, placeholder ranges and mm_hash.

    "USER: <image>\\nWhat is this?" + [img]
        -> pixels = ImageProcessor(img)                         float32 (C, H, W)
        -> "<image>" expanded to N copies (N = tokens the encoder yields for H x W), tokenized
        -> MultiModalFeature(mm_hash, offset = first placeholder index, length = N, pixels)

`mm_hash` = sha256(encoder fingerprint | pixel shape and dtype | pixel bytes): equal hashes mean
equal encoder outputs, so it keys the encoder cache and enters the block hash of every KV block
whose tokens include that image's placeholders (block_extra_keys), so prompts with the same text
and different images never share KV. No torch here: the scheduler and KV cache manager read only
offset, length and mm_hash; the model runner reads the pixels.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy only where pixels are handled: the KV cache manager imports this module
    import numpy as np

_HASH_TAG = b"pdcluster.mm_hash.v1\x00"


@dataclass(frozen=True)
class MultiModalLimits:
    max_images_per_request: int
    max_image_bytes: int  # encoded image (bytes given instead of a PIL image, data URLs)
    max_image_pixels: int  # width * height of the decoded image


@dataclass
class MultiModalFeature:
    mm_hash: str  # hex sha256
    offset: int  # index of the first placeholder token in the prompt
    length: int  # number of placeholder tokens (= encoder output rows)
    pixel_values: Any  # np.ndarray float32 (C, H, W)
    # The encoder output an EC connector fetched for this request (engine/ec_connector.py), taken
    # by the embedder instead of running the tower; None: encode (or hit the local cache).
    remote_output: Any = None

    @property
    def end(self) -> int:
        return self.offset + self.length


def mm_hash(pixel_values: np.ndarray, fingerprint: str) -> str:
    import numpy as np

    h = hashlib.sha256(_HASH_TAG)
    h.update(fingerprint.encode())
    h.update(repr((tuple(pixel_values.shape), str(pixel_values.dtype))).encode())
    h.update(np.ascontiguousarray(pixel_values).tobytes())
    return h.hexdigest()


def block_extra_keys(features: list[MultiModalFeature], start: int, end: int) -> tuple | None:
    """The mm_hashes of the images whose placeholders overlap tokens [start, end), in order."""
    keys = tuple(f.mm_hash for f in features if f.offset < end and start < f.end)
    return keys or None


def load_image(item: Any, limits: MultiModalLimits, index: int) -> Any:
    """A PIL image or encoded image bytes -> a PIL image within the limits (ValueError naming them).
    Bytes are checked before decoding and the size before the pixels are read (PIL opens lazily)."""
    from PIL import Image

    where = f"multi_modal_data['image'][{index}]"
    if isinstance(item, (bytes, bytearray, memoryview)):
        if len(item) > limits.max_image_bytes:
            raise ValueError(f"{where} is {len(item)} bytes; max_image_bytes is {limits.max_image_bytes}")
        try:
            image = Image.open(io.BytesIO(bytes(item)))
        except Exception as e:  # PIL raises several types for garbage
            raise ValueError(f"{where} is not a decodable image: {e}") from None
        _check_pixels(image, limits, where)
        try:
            image.load()
        except Exception as e:
            raise ValueError(f"{where} is not a decodable image: {e}") from None
        return image
    if isinstance(item, Image.Image):
        _check_pixels(item, limits, where)
        return item
    raise ValueError(f"{where} must be a PIL.Image.Image or encoded image bytes, got {type(item).__name__}")


def _check_pixels(image: Any, limits: MultiModalLimits, where: str) -> None:
    w, h = image.size
    if w < 1 or h < 1 or w * h > limits.max_image_pixels:
        raise ValueError(f"{where} is {w}x{h} = {w * h} pixels; max_image_pixels is {limits.max_image_pixels}")


class MultiModalInputProcessor:
    """Engine-side preprocessing for one multimodal checkpoint (LLaVA: CLIP pixels, `<image>`)."""

    def __init__(self, model_path: str, dtype: str, limits: MultiModalLimits, image_token: str = "<image>") -> None:
        from pdcluster.models.image_processor import ImageProcessor
        from pdcluster.models.llava_config import load_llava_vision_config

        self.vision = load_llava_vision_config(model_path)
        self.image_processor = ImageProcessor.from_pretrained(model_path)
        self.fingerprint = self.vision.fingerprint(model_path, dtype)
        self.limits = limits
        self.image_token = image_token
        self.image_token_id = self.vision.image_token_index

    def images_of(self, multi_modal_data: Any) -> list[Any]:
        if not isinstance(multi_modal_data, dict):
            raise ValueError("multi_modal_data must be a dict like {'image': PIL.Image or a list of them}")
        unknown = sorted(set(multi_modal_data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modality {unknown}; supported: ['image']")
        images = multi_modal_data.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else ([] if images is None else [images])
        if len(images) > self.limits.max_images_per_request:
            raise ValueError(f"multi_modal_data has {len(images)} images; "
                             f"max_images_per_request is {self.limits.max_images_per_request}")
        return images

    def preprocess(self, prompt: Any, multi_modal_data: Any) -> tuple[Any, list[np.ndarray]]:
        """-> (the prompt with each `<image>` expanded to its placeholder count, pixels per image).
        A token-id prompt is returned as given: it must hold every image's placeholders already
        (what a router that tokenized the expanded text sends); features() checks the count."""
        images = self.images_of(multi_modal_data)
        pixels = [self.image_processor.preprocess(load_image(im, self.limits, i)) for i, im in enumerate(images)]
        if not isinstance(prompt, str):
            return prompt, pixels
        parts = prompt.split(self.image_token)
        if len(parts) - 1 != len(pixels):
            raise ValueError(f"prompt has {len(parts) - 1} {self.image_token!r} placeholders for {len(pixels)} images")
        out = [parts[0]]
        for px, rest in zip(pixels, parts[1:]):
            out.append(self.image_token * self.vision.num_image_tokens(px.shape[1], px.shape[2]))
            out.append(rest)
        return "".join(out), pixels

    def features(self, token_ids: list[int], pixels: list[np.ndarray]) -> list[MultiModalFeature]:
        """Assign the placeholder tokens, in prompt order, to the images, in the same order."""
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        counts = [self.vision.num_image_tokens(px.shape[1], px.shape[2]) for px in pixels]
        if len(positions) != sum(counts):
            raise ValueError(f"prompt tokenized to {len(positions)} image placeholder tokens; "
                             f"its images need {sum(counts)}")
        feats, k = [], 0
        for px, n in zip(pixels, counts):
            run = positions[k:k + n]
            if run[-1] - run[0] != n - 1:
                raise ValueError("an image's placeholder tokens must be contiguous in the prompt")
            feats.append(MultiModalFeature(mm_hash(px, self.fingerprint), run[0], n, px))
            k += n
        return feats


def make_mm_processor(config: Any) -> MultiModalInputProcessor | None:
    """The input processor for an EngineConfig's model, or None for a text-only model."""
    from pdcluster.models.llava_config import LLAVA_ARCHITECTURE

    if config.model.architecture != LLAVA_ARCHITECTURE:
        return None
    mm = config.mm
    limits = MultiModalLimits(mm.max_images_per_request, mm.max_image_bytes, mm.max_image_pixels)
    return MultiModalInputProcessor(config.model.model_path, config.model.dtype, limits)
