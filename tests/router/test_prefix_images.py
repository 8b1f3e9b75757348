"""Prefix-aware routing with images: the router cannot compute mm_hash (a hash of preprocessed
pixels), so its chain stops before the first block covering an image placeholder. Those leading
blocks equal the workers' hashes (no image key there); every later worker block carries one, so
a same-text/other-image prompt is never counted as cached."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from pdcluster._proto import common_pb2
from pdcluster.engine.block_hash import compute_block_hashes, hash_block_tokens
from pdcluster.engine.mm_inputs import MultiModalFeature, block_extra_keys
from pdcluster.router.config import RouterConfig
from pdcluster.router.legs import LegRunner
from pdcluster.router.policies import PrefixAware, RouteRequest, WorkerStats, WorkerView
from pdcluster.router.prefix_index import PrefixIndex
from pdcluster.router.preprocess import PreparedRequest
from pdcluster.router.request_state import RequestState

BS = 4
IMG = 99
W = [WorkerView("w0", "127.0.0.1:9000"), WorkerView("w1", "127.0.0.1:9001")]


def worker_hashes(ids: list[int], images: list[tuple[int, int, str]]) -> list[bytes]:
    """What a worker's KV cache manager reports: images given as (offset, length, mm_hash)."""
    feats = [MultiModalFeature(h, off, n, None) for off, n, h in images]
    out: list[bytes] = []
    for i in range(len(ids) // BS):
        start, end = i * BS, (i + 1) * BS
        out.append(hash_block_tokens(out[-1] if out else None, ids[start:end], block_extra_keys(feats, start, end)))
    return out


def prompt(text_before: int, n_img: int = 8, text_after: int = 6) -> list[int]:
    return list(range(1, text_before + 1)) + [IMG] * n_img + list(range(50, 50 + text_after))


@pytest.mark.parametrize("offset", [0, 3, 4, 7, 8])
def test_chain_stops_before_the_first_placeholder_block(offset: int) -> None:
    ids = prompt(offset)
    policy = PrefixAware(PrefixIndex())
    got = list(policy.block_hashes(RouteRequest("r", ids, mm_offset=offset), BS) or ())
    assert len(got) == offset // BS  # only blocks ending at or before the placeholder
    a = worker_hashes(ids, [(offset, 8, "a" * 64)])
    b = worker_hashes(ids, [(offset, 8, "b" * 64)])
    assert got == a[:len(got)] == b[:len(got)]  # equal to what both workers report
    assert a[len(got)] != b[len(got)]  # the next block already differs by image
    # Without mm_offset the router would hash a block neither worker holds (the old over-count).
    assert compute_block_hashes(ids, BS)[len(got)] not in (a[len(got)], b[len(got)])


def test_same_text_other_image_is_not_counted_as_cached() -> None:
    ids = prompt(8)
    index = PrefixIndex()
    index.add_blocks("w0", worker_hashes(ids, [(8, 8, "a" * 64)]))  # w0 served the text with image A
    policy = PrefixAware(index)
    req = RouteRequest("r", ids, policy.block_hashes(RouteRequest("r", ids, mm_offset=8), BS), mm_offset=8)
    # Image B: only the 2 text blocks before the image are really cached on w0, never more.
    assert policy.prefix_match(req, W) == {"w0": 2}
    # A text-only prompt equal to the tokens (no images) matches nothing of w0's image blocks either.
    assert policy.prefix_match(RouteRequest("t", ids, compute_block_hashes(ids, BS)), W) == {"w0": 2}


def test_a_cached_text_prefix_scores_as_its_share_of_the_prompt() -> None:
    ids = prompt(8, n_img=24)  # 40 tokens, 8 of them before the image
    index = PrefixIndex()
    index.add_blocks("w0", compute_block_hashes(ids[:8], BS))
    policy = PrefixAware(index)
    req = RouteRequest("r", ids, policy.block_hashes(RouteRequest("r", ids, mm_offset=8), BS), mm_offset=8)
    busy = {"w0": WorkerStats(num_running=4), "w1": WorkerStats()}
    # share 8/40 = 0.2 cached vs a load penalty of 0.5: the idle worker wins...
    assert policy.pick(req, W, busy).worker_id == "w1"
    # ...while the whole chain seen alone (no mm_offset) would call w0 fully cached and pick it.
    assert policy.pick(RouteRequest("r", ids, req.block_hashes), W, busy).worker_id == "w0"
    assert policy.pick(req, W, {}).worker_id == "w0"  # equal load: the cached prefix still counts


def test_leg_runner_passes_the_offset_to_the_policy() -> None:
    ids = prompt(5)
    prep = PreparedRequest("r", ids, common_pb2.SamplingParams(), max_tokens=4, images=[b"png"], mm_offset=5)
    registry: Any = SimpleNamespace(first_info=lambda: SimpleNamespace(block_size=BS))
    legs = LegRunner(RouterConfig(), registry, PrefixAware(PrefixIndex()), metrics=None)  # type: ignore[arg-type]
    assert legs.block_hashes(RequestState(prep, "grpc")) == compute_block_hashes(ids[:4], BS)


def test_preprocessor_sets_the_offset_with_a_tiny_llava(tmp_path) -> None:
    import base64
    import io

    from models.llava_tiny import IMAGE_TOKEN_ID, make_tiny_llava, random_image

    from pdcluster.engine.tokenizer import Tokenizer
    from pdcluster.router.openai_images import load_image_placeholders
    from pdcluster.router.openai_protocol import parse_chat
    from pdcluster.router.preprocess import Preprocessor

    ckpt = make_tiny_llava(tmp_path / "ckpt", seed=1)
    with open(f"{ckpt}/chat_template.jinja", "w") as f:  # typed parts, the text before the image
        f.write("{% for m in messages %}{{ m['role'] + ': ' }}{% for c in m['content'] %}"
                "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")
    pre = Preprocessor(Tokenizer.from_pretrained(ckpt), served_model_names=["m"], max_model_len=512,
                       image_placeholders=load_image_placeholders(ckpt))
    buf = io.BytesIO()
    random_image(3).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    req, _ = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "t5 t6"}, {"type": "image_url", "image_url": {"url": url}}]}],
        "max_tokens": 2}, "m")
    prep = asyncio.run(pre.prepare(req, None))
    assert prep.mm_offset == prep.prompt_token_ids.index(IMAGE_TOKEN_ID)
    text, _ = parse_chat({"messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 2}, "m")
    assert asyncio.run(pre.prepare(text, None)).mm_offset is None
