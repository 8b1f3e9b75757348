"""A tiny random LLaVA behind `pdcluster serve` for the deployment test: its chat template, the
worker flags, one chat request with an image, and the offline text of the same request (the
same shapes as tests/cluster/test_serve_epd.py, whose module name is shadowed here by the
project's `cluster` package)."""

from __future__ import annotations

import base64
import io
from typing import Any

MAX_NEW = 6
PROMPT = "USER: <image>\nt5 t6 ASSISTANT:"  # what LLAVA_TEMPLATE renders for one image + "t5 t6"
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
WORKER_ARGS = "--max-model-len 256 --num-kv-blocks 64 --block-size 4"


def make_checkpoint(path: str) -> str:
    from models.llava_tiny import make_tiny_llava

    path = make_tiny_llava(path, seed=1)
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write(LLAVA_TEMPLATE)
    return path


def chat(ready: dict, image: Any) -> str:
    import openai

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", timeout=120, max_retries=0)
    out = client.chat.completions.create(
        model="ckpt", max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "t5 t6"}]}])
    return str(out.choices[0].message.content)


def offline_text(ckpt: str, image: Any) -> str:
    from pdcluster import LLM, SamplingParams

    llm = LLM(ckpt, num_kv_blocks=64, block_size=4)
    try:
        greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        return llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}], greedy)[0].outputs[0].text
    finally:
        llm.shutdown()
