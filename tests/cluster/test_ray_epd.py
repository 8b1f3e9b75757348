"""`pdcluster up --encode 1 --prefill 1 --decode 1` on a loopback Ray head (ray, slow): a tiny
random LLaVA served through the router; the same image twice equals the offline text and is
computed once in the cluster (sum of pdcluster_mm_items_total{source="computed"} over the
instances' /metrics); `down` in the finalizer."""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.request

import pytest
import ray_up
from models.llava_tiny import make_tiny_llava, random_image
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


@pytest.fixture
def cluster_env(tmp_path):
    yield from ray_up.cluster_env(tmp_path, "ec")


def _computed(ready: dict) -> float:
    total = 0.0
    for inst in ready["instances"].values():
        with urllib.request.urlopen(inst["metrics"], timeout=10) as resp:
            text = resp.read().decode()
        total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "pdcluster_mm_items_total" and s.labels.get("source") == "computed")
    return total


def test_up_epd_serves_an_image_computed_once(cluster_env, tmp_path) -> None:
    import openai

    from pdcluster import LLM, SamplingParams

    env, ns = cluster_env
    ckpt = make_tiny_llava(tmp_path / "ckpt", seed=1)
    with open(f"{ckpt}/chat_template.jinja", "w") as f:
        f.write(TEMPLATE)
    image = random_image(11)
    llm = LLM(ckpt, num_kv_blocks=64, block_size=4)
    try:
        want = llm.generate([{"prompt": "USER: <image>\nt5 t6 ASSISTANT:", "multi_modal_data": {"image": image}}],
                            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    finally:
        llm.shutdown()
    up = ray_up.cli(env, "up", "--detach", "--model", ckpt, "--encode", "1", "--prefill", "1", "--decode", "1",
             "--connector", "p2p", "--grpc-port", "0", "--http-port", "0", "--namespace", ns, "--num-cpus", "4",
             "--max-model-len", "256", "--num-kv-blocks", "64", "--block-size", "4", "--policy", "round_robin",
             timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    line = next(x for x in up.stdout.splitlines() if x.startswith("PDCLUSTER_READY "))
    ready = json.loads(line.split(" ", 1)[1])
    assert {i["role"] for i in ready["instances"].values()} == {"encode", "prefill", "decode"}
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", timeout=120, max_retries=0)
    for _ in range(2):
        out = client.chat.completions.create(
            model=ready["model"], max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "t5 t6"}]}])
        assert out.choices[0].message.content == want
    deadline = time.monotonic() + 20
    while _computed(ready) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _computed(ready) == 1
