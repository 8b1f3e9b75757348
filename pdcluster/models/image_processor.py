"""CLIP-style image preprocessing from a checkpoint's preprocessor_config.json, with Pillow and numpy.

The steps and their numerics are those of transformers' PIL backend (CLIPImageProcessorPil,
LlavaImageProcessorPil), so pixel values equal transformers' to the bit on the same input:

    convert RGB   alpha composited onto white (transformers' convert_to_rgb)
    resize        shortest edge -> size["shortest_edge"] (long edge int(s * long / short)), or an
                  explicit height x width; PIL resampling (BICUBIC by default) on uint8
    center crop   to crop_size, zero-padded when the image is smaller
    rescale       float64 * rescale_factor, then float32
    normalize     (x - mean) / std in float32, per channel

Output: float32 (C, H, W). No torch: the engine hashes these bytes before the model sees them.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_CONFIG_FILES = ("preprocessor_config.json", "processor_config.json")


@dataclass(frozen=True)
class ImageProcessor:
    shortest_edge: int | None = 224
    resize_hw: tuple[int, int] | None = None  # explicit (height, width) instead of shortest_edge
    crop_hw: tuple[int, int] | None = (224, 224)
    resample: int = 3  # PIL.Image.BICUBIC
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path) -> ImageProcessor:
        root = pathlib.Path(path)
        raw: dict[str, Any] | None = None
        for name in _CONFIG_FILES:
            f = root / name
            if f.is_file():
                data = json.loads(f.read_text())
                raw = data.get("image_processor", data)  # processor_config.json nests it
                break
        if raw is None:
            raise FileNotFoundError(f"no preprocessor_config.json in {str(root)!r}: a multimodal checkpoint needs one")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ImageProcessor:
        if raw.get("do_pad"):
            raise ValueError("preprocessor_config.json: do_pad (pad to square) is not supported")
        size = raw.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        shortest = size.get("shortest_edge")
        resize_hw = (int(size["height"]), int(size["width"])) if "height" in size and "width" in size else None
        if shortest is None and resize_hw is None:
            raise ValueError(f"preprocessor_config.json: size {size!r} is not supported "
                             "(expected shortest_edge or height and width)")
        crop = raw.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            shortest_edge=int(shortest) if shortest is not None and resize_hw is None else None,
            resize_hw=resize_hw,
            crop_hw=(int(crop["height"]), int(crop["width"])),
            resample=int(raw.get("resample", 3)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            image_mean=tuple(float(x) for x in raw.get("image_mean", _CLIP_MEAN)),
            image_std=tuple(float(x) for x in raw.get("image_std", _CLIP_STD)),
            do_resize=bool(raw.get("do_resize", True)),
            do_center_crop=bool(raw.get("do_center_crop", True)),
            do_rescale=bool(raw.get("do_rescale", True)),
            do_normalize=bool(raw.get("do_normalize", True)),
            do_convert_rgb=bool(raw.get("do_convert_rgb", True)),
        )

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the pixel values for an input image of height x width."""
        if self.do_center_crop and self.crop_hw is not None:
            return self.crop_hw
        return self._resize_hw(height, width) if self.do_resize else (height, width)

    def _resize_hw(self, height: int, width: int) -> tuple[int, int]:
        if self.resize_hw is not None:
            return self.resize_hw
        assert self.shortest_edge is not None
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def preprocess(self, image: Any) -> np.ndarray:
        """A PIL image -> float32 pixel values (C, H, W)."""
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise ValueError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
        if self.do_convert_rgb:
            image = _to_rgb(image)
        if self.do_resize:
            h, w = self._resize_hw(image.height, image.width)
            image = image.resize((w, h), resample=self.resample)
        arr = np.array(image)
        arr = arr[None] if arr.ndim == 2 else np.moveaxis(arr, -1, 0)  # (C, H, W)
        if self.do_center_crop and self.crop_hw is not None:
            arr = _center_crop(arr, self.crop_hw)
        if self.do_rescale:
            arr = (arr.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            x = arr if np.issubdtype(arr.dtype, np.floating) else arr.astype(np.float32)
            mean = np.array(self.image_mean, dtype=x.dtype)
            std = np.array(self.image_std, dtype=x.dtype)
            arr = ((x.T - mean) / std).T
        return np.ascontiguousarray(arr, dtype=np.float32)


def _to_rgb(image: Any) -> Any:
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _center_crop(arr: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    h, w = arr.shape[-2:]
    ch, cw = size
    top, left = (h - ch) // 2, (w - cw) // 2
    if top >= 0 and left >= 0 and top + ch <= h and left + cw <= w:
        return arr[..., top:top + ch, left:left + cw]
    # Smaller than the crop: pad with zeros (centered), then crop, as transformers does.
    nh, nw = max(ch, h), max(cw, w)
    padded = np.zeros(arr.shape[:-2] + (nh, nw), dtype=arr.dtype)
    tp, lp = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
    padded[..., tp:tp + h, lp:lp + w] = arr
    top, left = (nh - ch) // 2, (nw - cw) // 2
    return padded[..., top:top + ch, left:left + cw]
