"""`pdcluster serve --workers 1` on a tiny LLaVA checkpoint: the official openai client sends a
chat with an image; the served text equals the offline LLM.generate text for the same prompt and
image and transformers' greedy tokens; the same image again is served from the worker's encoder
cache (its /metrics); text-only chat still works; bad image bytes are a 400 naming `images`, an
oversize image or too many images a 400 naming the limit, and the server keeps answering."""

from __future__ import annotations

import base64
import io
import time
import urllib.request

import pytest
from models.llava_tiny import hf_greedy, make_tiny_llava, random_image
from prometheus_client.parser import text_string_to_metric_families
from serve_procs import start_serve, stop_serve

from pdcluster import LLM, SamplingParams
from pdcluster.engine.tokenizer import Tokenizer

MAX_NEW = 6
# llava-hf/llava-1.5-7b-hf's chat template (its {% generation %} markers dropped), as in
# tests/router/test_mm_serving.py (which checks its rendering against transformers').
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _mm_items(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {s.labels["source"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "pdcluster_mm_items_total"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    ckpt = make_tiny_llava(tmp_path_factory.mktemp("llava") / "ckpt", seed=1)
    with open(f"{ckpt}/chat_template.jinja", "w") as f:
        f.write(LLAVA_TEMPLATE)
    proc, ready = start_serve(["--model", ckpt, "--workers", "1", "--policy", "round_robin",
                               "--max-image-bytes", "20000", "--max-images-per-request", "3",
                               "--worker-args", "--max-model-len 256 --num-kv-blocks 64 --block-size 4"])
    try:
        yield ckpt, ready
    finally:
        stop_serve(proc)


def _chat(ready: dict, messages: list) -> str:
    import openai

    client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", timeout=120, max_retries=0)
    out = client.chat.completions.create(model="ckpt", messages=messages,
                                         max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].message.content


def _grpc_chat(address: str, image: bytes, text: str) -> list[int]:
    """The router's own gRPC Generate with ChatMessage.parts (an image, then text)."""
    import grpc

    from pdcluster._proto import common_pb2, router_pb2, router_pb2_grpc

    req = router_pb2.GenerateRequest(sampling_params=common_pb2.SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True), stream=False)
    req.chat.add_generation_prompt = True
    msg = req.chat.messages.add(role="user")
    msg.parts.add(image=image)
    msg.parts.add(text=text)
    with grpc.insecure_channel(address) as channel:
        return [t for r in router_pb2_grpc.RouterStub(channel).Generate(req, timeout=120) for t in r.token_ids]


def test_served_image_chat_equals_offline_and_transformers(served) -> None:
    ckpt, ready = served
    image = random_image(11)
    url = data_url(png_bytes(image))
    tok = Tokenizer.from_pretrained(ckpt)
    user = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": "t5 t6"}]}
    served_text = _chat(ready, [user])
    prompt = "USER: <image>\nt5 t6 ASSISTANT:"  # what the template renders (test_mm_serving checks it)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    llm = LLM(ckpt, num_kv_blocks=64, block_size=4)
    try:
        offline = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}], greedy)[0].outputs[0]
        text_only = llm.generate([{"prompt": "USER: t5 t6 ASSISTANT:"}], greedy)[0].outputs[0]
    finally:
        llm.shutdown()
    assert served_text == offline.text
    assert offline.token_ids == hf_greedy(ckpt, prompt, [image], MAX_NEW)
    assert tok.decode(offline.token_ids).strip() == served_text.strip()  # (the stream's text starts with a space)

    metrics = ready["instances"]["worker-0"]["metrics"] if "worker-0" in ready["instances"] else \
        next(iter(ready["instances"].values()))["metrics"]
    deadline = time.monotonic() + 30
    while _mm_items(metrics).get("computed", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _mm_items(metrics) == {"computed": 1.0, "local_cache": 0.0}
    # the same image behind other text (no prefix hit over it): the tower does not run again
    again = _chat(ready, [{"role": "system", "content": "t9"}, user])
    assert isinstance(again, str) and again
    deadline = time.monotonic() + 30
    while _mm_items(metrics).get("local_cache", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _mm_items(metrics) == {"computed": 1.0, "local_cache": 1.0}

    # text-only chat on the same server
    assert _chat(ready, [{"role": "user", "content": "t5 t6"}]) == text_only.text
    # the router's gRPC frontend takes the same image as ChatMessage.parts
    assert _grpc_chat(ready["grpc"], png_bytes(image), "t5 t6") == offline.token_ids


def test_bad_image_bytes_are_a_400_naming_the_field(served) -> None:
    import openai

    _, ready = served
    garbage = b"\x89PNG\r\n\x1a\n" + b"not really a png" * 4
    bad = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(garbage)}},
                                       {"type": "text", "text": "t5"}]}
    with pytest.raises(openai.BadRequestError, match=r"images\[0\] is not a decodable image"):
        _chat(ready, [bad])
    remote = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}
    with pytest.raises(openai.BadRequestError, match="never fetches a URL"):
        _chat(ready, [remote])
    jpeg = base64.b64encode(b"\xff\xd8\xff" + b"\0" * 10).decode()
    with pytest.raises(openai.BadRequestError, match=r"images\[0\]"):
        _chat(ready, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + jpeg}}]}])
    big = {"type": "image_url", "image_url": {"url": data_url(png_bytes(random_image(13, 100, 100)))}}
    with pytest.raises(openai.BadRequestError, match="max_image_bytes=20000"):
        _chat(ready, [{"role": "user", "content": [big]}])
    small = {"type": "image_url", "image_url": {"url": data_url(png_bytes(random_image(14)))}}
    with pytest.raises(openai.BadRequestError, match="max_images_per_request=3"):
        _chat(ready, [{"role": "user", "content": [small] * 4}])
    # the engine keeps working
    ok = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png_bytes(random_image(12)))}},
                                      {"type": "text", "text": "t5"}]}
    assert _chat(ready, [ok])


def _sample(url: str, name: str, labels: dict[str, str]) -> float:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_disaggregated_image_chat_equals_offline(tmp_path) -> None:
    """1P+1D over p2p: both legs get the image bytes, so the decode worker's block hashes carry the
    same mm_hash as the prefill worker's; the KV is handed off and the tower runs on the prefill side."""
    import openai

    ckpt = make_tiny_llava(tmp_path / "ckpt", seed=1)
    with open(f"{ckpt}/chat_template.jinja", "w") as f:
        f.write(LLAVA_TEMPLATE)
    image = random_image(21)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    llm = LLM(ckpt, num_kv_blocks=64, block_size=4)
    try:
        prompt = "USER: <image>\nt5 t6 ASSISTANT:"
        offline = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}], greedy)[0].outputs[0].text
    finally:
        llm.shutdown()
    proc, ready = start_serve(["--model", ckpt, "--prefill", "1", "--decode", "1", "--connector", "p2p",
                               "--policy", "round_robin",
                               "--worker-args", "--max-model-len 256 --num-kv-blocks 64 --block-size 4"])
    try:
        client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", timeout=120, max_retries=0)
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}},
                                                 {"type": "text", "text": "t5 t6"}]}]
        out = client.chat.completions.create(model="ckpt", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert out.choices[0].message.content == offline
        decode = ready["instances"]["decode-0"]["metrics"]
        prefill = ready["instances"]["prefill-0"]["metrics"]
        deadline = time.monotonic() + 30
        while _sample(decode, "pdcluster_connector_loads_total", {"result": "ok"}) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _sample(decode, "pdcluster_connector_loads_total", {"result": "ok"}) >= 1  # the KV was handed off
        assert _sample(prefill, "pdcluster_mm_items_total", {"source": "computed"}) == 1
        # the decode worker computes only the tokens after the loaded KV: no image placeholder
        assert _sample(decode, "pdcluster_mm_items_total", {"source": "computed"}) == 0
    finally:
        stop_serve(proc)
