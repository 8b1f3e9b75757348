"""The router in front of real `pdcluster serve-worker` processes (demo model, CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import openai
import pytest

from pdcluster._proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdcluster.cluster.local_launcher import LocalLauncher, WorkerSpec

SP = common_pb2.SamplingParams
PROMPTS = ["The prefill pool reads the whole prompt", "Hello, world!", "Tokens, blocks, pages and caches"]
WORKER_ENV = {"PDCLUSTER_DEVICE": "cpu"}


def worker_args(model: str, name: str, key_dir, port: int = 0) -> list[str]:
    return ["--role", "both", "--model", model, "--worker-id", name, "--port", str(port), "--max-model-len", "512",
            "--key-dir", str(key_dir)]


@pytest.fixture(scope="module")
def real_workers(demo_model, key_dir):
    launcher = LocalLauncher(env=WORKER_ENV, echo_logs=False, grace_s=10)
    try:
        procs = launcher.start([WorkerSpec(f"rw{i}", worker_args(demo_model, f"rw{i}", key_dir)) for i in range(2)])
        yield launcher, procs
    finally:
        launcher.stop()


def worker_stats(address: str) -> common_pb2.WorkerStats:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5)


def wait_until(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def start_router(loop_thread, demo_model, addresses, **kw):
    from pdcluster.router.app import Router
    from pdcluster.router.config import RouterConfig

    router = Router(RouterConfig(workers=tuple(addresses), model=demo_model, grpc_port=0, http_port=0,
                                 health_interval_s=0.2, **kw))
    loop_thread.run(router.start())
    assert loop_thread.run(router.registry.wait_for_healthy(len(addresses), 20), 30)
    return router


def test_router_tokens_equal_offline_llm(real_workers, loop_thread, demo_model):
    from pdcluster import LLM, SamplingParams

    _, procs = real_workers
    router = start_router(loop_thread, demo_model, [p.address for p in procs], policy="round_robin")
    try:
        with grpc.insecure_channel(router.grpc_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            got = []
            for prompt in PROMPTS:
                out = list(stub.Generate(router_pb2.GenerateRequest(prompt=prompt, stream=True, sampling_params=SP(
                    max_tokens=12, temperature=0, ignore_eos=True)), timeout=60))
                got.append([t for r in out for t in r.token_ids])
        oa = openai.OpenAI(base_url=router.http_url + "/v1", api_key="x", max_retries=0)
        text = oa.completions.create(model=demo_model, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
        chat = oa.chat.completions.create(model=demo_model, messages=[{"role": "user", "content": PROMPTS[1]}],
                                          max_tokens=6, temperature=0, stream=True)
        chat_text = "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices)
    finally:
        loop_thread.run(router.stop(0.5))
    llm = LLM(demo_model, max_model_len=512)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = llm.generate(PROMPTS, params)
    assert got == [list(o.outputs[0].token_ids) for o in expected]
    assert text == expected[0].outputs[0].text
    ref_chat = llm.chat([{"role": "user", "content": PROMPTS[1]}], SamplingParams(max_tokens=6, temperature=0))
    assert chat_text == ref_chat.outputs[0].text


def test_cancel_and_deadline_free_every_block(real_workers, loop_thread, demo_model):
    _, procs = real_workers
    router = start_router(loop_thread, demo_model, [procs[0].address], policy="round_robin")
    try:
        with grpc.insecure_channel(router.grpc_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            req = router_pb2.GenerateRequest(prompt=PROMPTS[0] * 8, stream=True,
                                             sampling_params=SP(max_tokens=400, ignore_eos=True))
            stream = stub.Generate(req, timeout=60)
            next(stream)
            assert worker_stats(procs[0].address).num_running == 1
            stream.cancel()
            assert wait_until(lambda: (s := worker_stats(procs[0].address)).num_running == 0
                              and s.num_kv_blocks_used == 0)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=0.5))
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert wait_until(lambda: (s := worker_stats(procs[0].address)).num_running == 0
                              and s.num_kv_blocks_used == 0)
    finally:
        loop_thread.run(router.stop(0.5))


def test_prefix_aware_uses_real_kv_events(real_workers, loop_thread, demo_model, key_dir):
    _, procs = real_workers
    router = start_router(loop_thread, demo_model, [p.address for p in procs], policy="prefix_aware",
                          key_dir=str(key_dir))
    try:
        tok = router.preprocessor.tokenizer
        shared = tok.encode(" ".join(PROMPTS) * 12)[:160]  # 10 blocks of 16
        assert len(shared) == 160
        with grpc.insecure_channel(router.grpc_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)

            def run(tail: list[int]) -> router_pb2.GenerateResponse:
                return list(stub.Generate(router_pb2.GenerateRequest(
                    prompt_token_ids=router_pb2.TokenIds(ids=shared + tail), stream=True,
                    sampling_params=SP(max_tokens=2)), timeout=60))[-1]

            holder = run([5]).route.decode_worker_id
            assert wait_until(lambda: loop_thread.call(lambda: router.index.num_blocks(holder)) >= 10)
            for tail in ([6], [7, 8], [9, 10, 11]):
                last = run(tail)
                assert last.route.decode_worker_id == holder
                assert last.usage.cached_tokens >= 160
    finally:
        loop_thread.run(router.stop(0.5))


def test_ejection_and_readmission_of_a_real_worker(loop_thread, demo_model, key_dir):
    launcher = LocalLauncher(env=WORKER_ENV, echo_logs=False)
    try:
        (a, b) = launcher.start([WorkerSpec(f"ej{i}", worker_args(demo_model, f"ej{i}", key_dir)) for i in range(2)])
        router = start_router(loop_thread, demo_model, [a.address, b.address], policy="least_loaded")
        healthy = lambda: loop_thread.call(lambda: {h.worker_id for h in router.registry.handles if h.healthy})  # noqa: E731
        try:
            os.kill(a.pid, signal.SIGKILL)
            assert wait_until(lambda: healthy() == {"ej1"})
            with grpc.insecure_channel(router.grpc_address) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                for _ in range(3):
                    last = list(stub.Generate(router_pb2.GenerateRequest(prompt="hi", sampling_params=SP(
                        max_tokens=2)), timeout=30))[-1]
                    assert last.route.decode_worker_id == "ej1"
                launcher.start([WorkerSpec("ej0-again", worker_args(demo_model, "ej0", key_dir, port=a.ready["port"]))])
                assert wait_until(lambda: healthy() == {"ej0", "ej1"}, 20)
        finally:
            loop_thread.run(router.stop(0.5))
    finally:
        launcher.stop()


def test_router_process_has_no_torch(real_workers, demo_model):
    _, procs = real_workers
    cmd = [sys.executable, "-X", "importtime", "-m", "pdcluster.cluster.cli", "router", "--workers",
           ",".join(p.address for p in procs), "--grpc-port", "0", "--http-port", "0",  # model: from the workers
           "--health-interval", "0.2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        for line in proc.stdout:
            if line.startswith("PDCLUSTER_READY "):
                break
        ready = json.loads(line.split(" ", 1)[1])
        oa = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="x", max_retries=0)
        model = oa.models.list().data[0].id
        assert os.path.samefile(model, demo_model)
        assert oa.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in err.splitlines() if ln.startswith("import time:")}
    assert "pdcluster.router.app" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", "triton", "transformers")}
