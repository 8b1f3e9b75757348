"""`--dataset-name random-mm`: random text prompts (as `random`) with random images, vLLM's flags.

    --random-mm-base-items-per-request N      images per request around N (default 1)
    --random-mm-num-mm-items-range-ratio r    count drawn uniformly from [floor(N(1-r)), ceil(N(1+r))],
                                              the top clamped to the sum of the per-modality limits
                                              (a bottom above the top is an error)
    --random-mm-limit-mm-per-prompt JSON      hard caps per modality, e.g. '{"image": 3, "video": 0}';
                                              a modality at its cap has its buckets dropped and the
                                              other buckets' probabilities renormalised
    --random-mm-bucket-config DICT            {(height, width, num_frames): probability}; frames 1 is
                                              an image (videos are refused: only images are served);
                                              probabilities are normalised to sum to 1

Each image is uniform random RGB noise of its bucket's size, JPEG-encoded (as vLLM sends them: a
data URL part of an openai-chat message), so no two images are alike and nothing is shared by
chance. All randomness comes from --seed.
"""

from __future__ import annotations

import ast
import io
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from pdcluster.cluster.bench.datasets import sample_random
from pdcluster.cluster.bench.prompts import PromptBuilder
from pdcluster.cluster.bench.request import BenchRequest

DEFAULT_LIMIT = '{"image": 255, "video": 1}'
DEFAULT_BUCKETS = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}"
Bucket = tuple[int, int, int]


def parse_limit(text: str | Mapping[str, int]) -> dict[str, int]:
    """--random-mm-limit-mm-per-prompt: a JSON object of non-negative integers per modality."""
    try:
        value = json.loads(text) if isinstance(text, str) else dict(text)
    except ValueError as e:
        raise ValueError(f"--random-mm-limit-mm-per-prompt: not JSON ({e})") from None
    if not isinstance(value, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in value.values()):
        raise ValueError(f"--random-mm-limit-mm-per-prompt: must map modalities to integers >= 0, got {text!r}")
    unknown = sorted(set(value) - {"image", "video"})
    if unknown:
        raise ValueError(f"--random-mm-limit-mm-per-prompt: unknown modality {unknown}; known: image, video")
    return value


def parse_buckets(text: str | Mapping[Any, float]) -> dict[Bucket, float]:
    """--random-mm-bucket-config: {(h, w, frames): p} as a Python literal (vLLM's form) or JSON with
    "(h, w, frames)" string keys; normalised, zero-probability buckets dropped."""
    raw: Any = text
    if isinstance(text, str):
        try:
            raw = ast.literal_eval(text)  # literals only: never evaluates code
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"--random-mm-bucket-config: not a {{(height, width, frames): p}} literal ({e})") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"--random-mm-bucket-config: must be a non-empty dict, got {text!r}")
    out: dict[Bucket, float] = {}
    for key, p in raw.items():
        if isinstance(key, str):
            try:
                key = ast.literal_eval(key)
            except (ValueError, SyntaxError):
                raise ValueError(f"--random-mm-bucket-config: bad key {key!r}") from None
        ok = isinstance(key, tuple) and len(key) == 3 and all(isinstance(k, int) and k >= 1 for k in key)
        if not ok or isinstance(p, bool) or not isinstance(p, (int, float)) or p < 0:
            raise ValueError(f"--random-mm-bucket-config: {key!r}: {p!r} is not (height, width, frames): p >= 0")
        if p > 0:
            out[key] = float(p)
    if any(frames > 1 for _, _, frames in out):
        raise ValueError("--random-mm-bucket-config: video buckets (frames > 1) are not supported; only images")
    total = sum(out.values())
    if total <= 0:
        raise ValueError("--random-mm-bucket-config: no bucket has a positive probability")
    return {k: v / total for k, v in out.items()}


def item_count_range(base: int, ratio: float, limit: Mapping[str, int]) -> tuple[int, int]:
    if base < 0:
        raise ValueError(f"--random-mm-base-items-per-request must be >= 0, got {base}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--random-mm-num-mm-items-range-ratio must be in [0, 1], got {ratio}")
    low, high = math.floor(base * (1 - ratio)), math.ceil(base * (1 + ratio))
    high = min(high, sum(limit.values()))
    if low > high:
        raise ValueError(f"random-mm: at least {low} items per request but the limits allow {high} "
                         "(--random-mm-limit-mm-per-prompt)")
    return low, high


def random_image(rng: np.random.Generator, height: int, width: int) -> bytes:
    from PIL import Image

    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG")
    return buf.getvalue()


def sample_images(rng: np.random.Generator, count: int, buckets: Mapping[Bucket, float],
                  limit: Mapping[str, int]) -> list[bytes]:
    """`count` images from the buckets, at most limit["image"] (then the image buckets are out)."""
    keys = list(buckets)
    probs = np.array([buckets[k] for k in keys])
    count = min(count, limit.get("image", 0))
    picks = rng.choice(len(keys), size=count, p=probs) if count else []
    return [random_image(rng, keys[i][0], keys[i][1]) for i in picks]


def sample_random_mm(builder: PromptBuilder, num_requests: int, input_len: int, output_len: int,
                     range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0, *, base_items: int = 1,
                     items_range_ratio: float = 0.0, limit: str | Mapping[str, int] = DEFAULT_LIMIT,
                     buckets: str | Mapping[Any, float] = DEFAULT_BUCKETS) -> list[BenchRequest]:
    """`random`'s text requests, each with its images (see the module docstring)."""
    limits, bucket_probs = parse_limit(limit), parse_buckets(buckets)
    low, high = item_count_range(base_items, items_range_ratio, limits)
    texts = sample_random(builder, num_requests, input_len, output_len, range_ratio, prefix_len, seed=seed)
    rng = np.random.default_rng([seed, 1])  # its own stream: the texts equal `random`'s for one seed
    out = []
    for req in texts:
        count = int(rng.integers(low, high + 1))
        images = tuple(sample_images(rng, count, bucket_probs, limits))
        out.append(BenchRequest(req.prompt, req.prompt_len, req.expected_output_len, images=images))
    return out
