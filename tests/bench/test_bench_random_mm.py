"""`--dataset-name random-mm` (vLLM's flags and meanings): item counts in the range and under the
limits, bucket sizes and probabilities, images only, seeded; the openai-chat body carries the text
then one image_url part per image; other backends are refused."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
from collections import Counter

import pytest
from PIL import Image

from pdcluster.cluster.bench.backend import BackendConfig, make_backend
from pdcluster.cluster.bench.cli import add_serve_arguments
from pdcluster.cluster.bench.datasets import sample_random
from pdcluster.cluster.bench.prompts import PromptBuilder
from pdcluster.cluster.bench.random_mm import item_count_range, parse_buckets, parse_limit, sample_random_mm
from pdcluster.cluster.bench.request import BenchRequest


def _size(image: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(image)) as im:
        assert im.format == "JPEG" and im.mode == "RGB"
        return im.height, im.width


def test_flags_parse_as_vllm_defines_them() -> None:
    assert parse_limit('{"image": 3, "video": 0}') == {"image": 3, "video": 0}
    assert parse_buckets("{(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}") == {
        (256, 256, 1): 0.5, (720, 1280, 1): 0.5}  # the zero video bucket drops out
    assert parse_buckets('{"(32, 32, 1)": 3, "(16, 8, 1)": 1}') == {(32, 32, 1): 0.75, (16, 8, 1): 0.25}
    with pytest.raises(ValueError, match="video buckets"):
        parse_buckets("{(32, 32, 4): 1.0}")
    with pytest.raises(ValueError, match="bucket-config"):
        parse_buckets("__import__('os')")
    with pytest.raises(ValueError, match="unknown modality"):
        parse_limit('{"audio": 1}')
    assert item_count_range(2, 0.5, {"image": 9}) == (1, 3)
    assert item_count_range(4, 1.0, {"image": 3}) == (0, 3)  # the top is capped by the limits
    with pytest.raises(ValueError, match="limits allow 1"):
        item_count_range(4, 0.0, {"image": 1})


def test_requests_carry_random_images_of_the_buckets(builder: PromptBuilder) -> None:
    reqs = sample_random_mm(builder, 40, input_len=12, output_len=3, seed=5, base_items=2, items_range_ratio=0.5,
                            limit='{"image": 3, "video": 0}', buckets="{(32, 32, 1): 0.75, (16, 24, 1): 0.25}")
    counts = Counter(len(r.images) for r in reqs)
    assert set(counts) <= {1, 2, 3} and len(counts) > 1
    sizes = Counter(_size(i) for r in reqs for i in r.images)
    assert set(sizes) == {(32, 32), (16, 24)} and sizes[(32, 32)] > sizes[(16, 24)]
    assert len({i for r in reqs for i in r.images}) == sum(counts[k] * k for k in counts)  # no two alike
    texts = sample_random(builder, 40, input_len=12, output_len=3, seed=5)
    assert [r.prompt for r in reqs] == [t.prompt for t in texts]  # the same text as `random`
    again = sample_random_mm(builder, 40, input_len=12, output_len=3, seed=5, base_items=2, items_range_ratio=0.5,
                             limit='{"image": 3, "video": 0}', buckets="{(32, 32, 1): 0.75, (16, 24, 1): 0.25}")
    assert [r.images for r in again] == [r.images for r in reqs]  # seeded


def test_chat_body_has_the_text_then_the_images(fake_server) -> None:
    fake_server.ttft, fake_server.itl = 0.0, 0.0
    image = b"\xff\xd8\xff fake jpeg"

    async def send(backend_name: str, path: str):
        config = BackendConfig(backend_name, fake_server.url + path, model="m")
        async with make_backend(config) as backend:
            return await backend.request(BenchRequest("hello", 1, 2, images=(image, image)))

    r = asyncio.run(send("openai-chat", "/v1/chat/completions"))
    assert r.success, r.error
    content = fake_server.bodies[-1]["messages"][0]["content"]
    url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    assert content == [{"type": "text", "text": "hello"}, {"type": "image_url", "image_url": {"url": url}},
                       {"type": "image_url", "image_url": {"url": url}}]
    r = asyncio.run(send("openai", "/v1/completions"))
    assert not r.success and "openai-chat" in r.error


def test_serve_refuses_random_mm_without_the_chat_backend() -> None:
    from pdcluster.cluster.bench.serve import run_serve

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--dataset-name", "random-mm", "--backend", "openai", "--model", "m"])
    with pytest.raises(ValueError, match="use --backend openai-chat"):
        run_serve(args)
