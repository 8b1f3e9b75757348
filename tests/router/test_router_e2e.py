"""The router in front of real `pdcluster serve-worker` processes as a whole: the same tokens as
the offline engine through both frontends, and `pdcluster router` as its own process (no torch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import grpc
import openai

from pdcluster._proto import common_pb2, router_pb2, router_pb2_grpc

SamplingParams = common_pb2.SamplingParams
PROMPTS = ["The prefill pool reads the whole prompt", "Hello, world!", "Tokens, blocks, pages and caches"]


def test_router_tokens_equal_offline_llm(cluster, demo_model, reference):
    c = cluster(2)
    with grpc.insecure_channel(c.router.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        got = []
        for prompt in PROMPTS:  # round robin: both workers serve
            out = list(stub.Generate(router_pb2.GenerateRequest(prompt=prompt, stream=True, sampling_params=SamplingParams(
                max_tokens=12, temperature=0, ignore_eos=True)), timeout=60))
            got.append([t for r in out for t in r.token_ids])
    client = openai.OpenAI(base_url=c.http_url + "/v1", api_key="x", max_retries=0)
    text = client.completions.create(model=demo_model, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    chat = client.chat.completions.create(model=demo_model, messages=[{"role": "user", "content": PROMPTS[1]}],
                                      max_tokens=6, temperature=0, stream=True)
    chat_text = "".join(chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices)
    assert got == reference.batch_tokens(PROMPTS, 12)
    assert text == reference.generate(PROMPTS[0], max_tokens=12).text
    assert chat_text == reference.chat([{"role": "user", "content": PROMPTS[1]}], max_tokens=6, ignore_eos=False).text


def test_router_process_has_no_torch(worker_pool, demo_model):
    workers = worker_pool.take(2)
    cmd = [sys.executable, "-X", "importtime", "-m", "pdcluster.cluster.cli", "router", "--workers",
           ",".join(w.address for w in workers), "--grpc-port", "0", "--http-port", "0",  # model: from the workers
           "--health-interval", "0.2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        for line in proc.stdout:
            if line.startswith("PDCLUSTER_READY "):
                break
        ready = json.loads(line.split(" ", 1)[1])
        client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        assert os.path.samefile(model, demo_model)
        assert client.completions.create(model=model, prompt="hi", max_tokens=2,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 2
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
    assert "pdcluster.router.app" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", "triton", "transformers")}
