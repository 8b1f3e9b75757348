"""Encoder-cache sharing through `pdcluster serve` (real processes, a tiny random LLaVA made by
transformers at test time, float32, 127.0.0.1, free ports; every process stopped by pid):

    1E+1P+1D   the served text equals the offline aggregated text token for token; the same image
               in four requests is computed once in the whole cluster (sum over every instance's
               /metrics of pdcluster_mm_items_total{source="computed"}); the encoder SIGKILLed:
               requests still answer (the prefill worker encodes locally) and the next one too
    1E+2P+1D   four requests with one image over two prefill workers: computed once
    2P+1D      no encoder: the second prefill worker fetches the first one's encoding
"""

from __future__ import annotations

import base64
import io
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from models.llava_tiny import make_tiny_llava, random_image
from prometheus_client.parser import text_string_to_metric_families
from serve_procs import start_serve, stop_serve

pytestmark = pytest.mark.slow

MAX_NEW = 6
PROMPT = "USER: <image>\nt5 t6 ASSISTANT:"  # what LLAVA_TEMPLATE renders for one image + "t5 t6"
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
WORKER_ARGS = "--max-model-len 256 --num-kv-blocks 64 --block-size 4"


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _chat(ready: dict, image) -> str:
    import openai

    client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", timeout=120, max_retries=0)
    content: list = [{"type": "text", "text": "t5 t6"}]
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    out = client.chat.completions.create(
        model="ckpt", max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": content}])
    return out.choices[0].message.content


def _mm(ready: dict, source: str, names=None) -> float:
    total = 0.0
    for name, inst in ready["instances"].items():
        if names is not None and name not in names:
            continue
        with urllib.request.urlopen(inst["metrics"], timeout=10) as resp:
            text = resp.read().decode()
        total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "pdcluster_mm_items_total" and s.labels.get("source") == source)
    return total


def _settled(ready: dict, source: str, at_least: float, names=None) -> float:
    """Metrics are read from engine stats after each step: give them a moment to catch up."""
    deadline = time.monotonic() + 20
    value = _mm(ready, source, names)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
        value = _mm(ready, source, names)
    return value


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = make_tiny_llava(tmp_path_factory.mktemp("llava") / "ckpt", seed=1)
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write(LLAVA_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def offline(ckpt: str):
    from pdcluster import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    llm = LLM(ckpt, num_kv_blocks=64, block_size=4)
    try:
        def text(image) -> str:
            if image is None:  # the text-only chat of the same words
                return llm.generate([{"prompt": "USER: t5 t6 ASSISTANT:"}], greedy)[0].outputs[0].text
            return llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}], greedy)[0].outputs[0].text
        yield text
    finally:
        llm.shutdown()


def _serve(ckpt: str, *pools: str):
    return start_serve(["--model", ckpt, *pools, "--connector", "p2p", "--policy", "round_robin",
                        "--worker-args", WORKER_ARGS])


def test_epd_text_equals_offline_image_computed_once_and_encoder_loss(ckpt: str, offline) -> None:
    proc, ready = _serve(ckpt, "--encode", "1", "--prefill", "1", "--decode", "1")
    try:
        assert {i["role"] for i in ready["instances"].values()} == {"encode", "prefill", "decode"}
        assert all(i["metrics"] for i in ready["instances"].values())
        image = random_image(11)
        want = offline(image)
        for _ in range(4):
            assert _chat(ready, image) == want
        assert _settled(ready, "computed", 1) == 1  # once, in the whole cluster
        assert _mm(ready, "computed", {"encode-0"}) == 1  # ... on the encoder
        assert _settled(ready, "remote", 4, {"prefill-0"}) >= 1  # the prefill worker fetched it
        assert _chat(ready, None) == offline(None)  # text-only: no encoder step

        # the encoder dies: requests with new images still answer (P encodes locally), the next too
        os.kill(ready["instances"]["encode-0"]["pid"], signal.SIGKILL)
        images = [random_image(30 + i) for i in range(3)]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda im: _chat(ready, im), images[:2]))
        assert got == [offline(im) for im in images[:2]]
        assert _chat(ready, images[2]) == offline(images[2])
        assert _settled(ready, "computed", 3, {"prefill-0"}) == 3
    finally:
        stop_serve(proc)


def test_1e_2p_1d_four_requests_one_image_computed_once(ckpt: str) -> None:
    proc, ready = _serve(ckpt, "--encode", "1", "--prefill", "2", "--decode", "1")
    try:
        image = random_image(12)
        texts = {_chat(ready, image) for _ in range(4)}
        assert len(texts) == 1
        assert _settled(ready, "computed", 1) == 1
        assert _settled(ready, "remote", 2, {"prefill-0", "prefill-1"}) >= 2  # both prefill workers fetched
    finally:
        stop_serve(proc)


def test_two_prefill_workers_share_an_encoding_without_an_encoder(ckpt: str, offline) -> None:
    proc, ready = _serve(ckpt, "--prefill", "2", "--decode", "1")
    try:
        image = random_image(13)
        want = offline(image)
        assert _chat(ready, image) == want
        assert _chat(ready, image) == want  # round robin: the other prefill worker
        assert _settled(ready, "computed", 1) == 1
        assert _settled(ready, "remote", 1, {"prefill-0", "prefill-1"}) == 1
    finally:
        stop_serve(proc)
