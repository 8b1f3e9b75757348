"""pdcluster.client against a real router (`pdcluster router`) in front of a real worker
(`pdcluster serve-worker`), plus its pure request/response mapping."""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys
import time

import grpc
import pytest

from pdcluster._proto import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from pdcluster.client import AsyncClient, Client, ClientError, build_request, delta_from_proto
from pdcluster.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
IDS = [5, 6, 7, 8, 9, 10]


def test_import_does_not_pull_torch() -> None:
    code = "import sys, pdcluster.client; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    modules = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "pdcluster.client" in modules and not any(m.split(".")[0] == "torch" for m in modules)


def test_build_request_inputs() -> None:
    assert build_request("hi", None).WhichOneof("input") == "prompt"
    r = build_request("hi", None, chat=True)
    assert r.chat.messages[0].content == "hi" and r.chat.add_generation_prompt
    r = build_request([{"role": "system", "content": "s"}, {"role": "user", "content": "u", "name": "n"}], None)
    assert [m.role for m in r.chat.messages] == ["system", "user"] and r.chat.messages[1].name == "n"
    r = build_request([1, 2], SamplingParams(max_tokens=3), request_id="x", stream=False)
    assert list(r.prompt_token_ids.ids) == [1, 2] and r.sampling_params.max_tokens == 3 and not r.stream
    assert not r.sampling_params.HasField("temperature")  # defaults are left to the server
    assert build_request([], None).WhichOneof("input") == "prompt_token_ids"
    with pytest.raises(ValueError, match="token ids"):
        build_request([1, -1], None)


def test_delta_from_router_and_worker_responses() -> None:
    r = router_pb2.GenerateResponse(request_id="a", token_ids=[1], text="x", finished=True, stop_str="\n",
                                    finish_reason=common_pb2.FINISH_REASON_STOP, usage=common_pb2.Usage(prompt_tokens=2),
                                    prompt_token_ids=[9], first_token_time=3.0)
    d = delta_from_proto(r)
    assert (d.finish_reason, d.stop_reason, d.usage.prompt_tokens, d.prompt_token_ids) == ("stop", "\n", 2, [9])
    w = delta_from_proto(worker_pb2.WorkerGenerateResponse(request_id="b", token_ids=[4], error_message="boom",
                                                           finish_reason=common_pb2.FINISH_REASON_ERROR))
    assert w.error == "boom" and w.finish_reason == "error" and w.usage is None and w.route is None


# -- against a real router ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    from workers.worker_process import start_cli, start_worker

    from pdcluster.models.demo import ensure_demo_model

    model = str(ensure_demo_model(tmp_path_factory.mktemp("demo") / "model"))
    logs = tmp_path_factory.mktemp("client-logs")
    worker = start_worker(["--model", model, "--max-model-len", "256", "--worker-id", "cw0"], logs,
                          hold=True)  # ids "held-...": held after their first outputs (engine_hold.py)
    router = None
    try:
        router = start_cli(["router", "--workers", worker.address, "--grpc-port", "0", "--http-port", "-1",
                            "--policy", "least_loaded", "--health-interval", "0.2"], logs, timeout=120)
        yield worker, router
    finally:
        if router is not None:
            router.stop()
        worker.stop()


@pytest.fixture
def client(cluster):
    with Client(cluster[1].ready["grpc"], timeout=60) as c:
        c.wait_for_ready(10)
        yield c


def _worker_tokens(worker, ids: list[int], max_tokens: int) -> list[int]:
    with grpc.insecure_channel(worker.address) as ch:
        req = worker_pb2.WorkerGenerateRequest(prompt_token_ids=ids, stream=True, sampling_params=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return [t for r in worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=60) for t in r.token_ids]


def _wait_worker_idle(worker, timeout: float = 10.0) -> common_pb2.WorkerStats:
    with grpc.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        end = time.monotonic() + timeout
        while True:
            s = stub.Stats(worker_pb2.StatsRequest(), timeout=5)
            if (s.num_running == 0 and s.num_kv_blocks_used == 0) or time.monotonic() > end:
                return s
            time.sleep(0.05)


def test_generate_and_stream_match_the_worker(cluster, client: Client) -> None:
    worker, _ = cluster
    expected = _worker_tokens(worker, IDS, 10)
    result = client.generate(IDS, GREEDY, request_id="c-gen")
    assert result.token_ids == expected and result.finish_reason == "length" and result.error is None
    assert result.usage is not None and result.usage.completion_tokens == 10 and result.request_id == "c-gen"
    deltas = list(client.generate_stream(IDS, GREEDY))
    assert [t for d in deltas for t in d.token_ids] == expected
    assert "".join(d.text for d in deltas) == result.text and deltas[-1].finished
    assert deltas[-1].usage.prompt_tokens == len(IDS)


def test_text_and_chat_prompts(client: Client) -> None:
    for kwargs in ({}, {"chat": True}):
        r = client.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=4), **kwargs)
        assert r.finished and 0 < len(r.token_ids) <= 4
    r = client.generate([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0.0))
    assert r.finished and r.usage.prompt_tokens > 2


def test_errors_are_client_errors(client: Client) -> None:
    with pytest.raises(ClientError) as e:
        client.generate([1, 10**6], GREEDY)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message
    with pytest.raises(ClientError) as e:
        client.generate([], GREEDY)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ClientError) as e:
        client.generate(IDS, SamplingParams(max_tokens=240, ignore_eos=True), request_id="held-late", deadline_s=0.3)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.generate(IDS, SamplingParams(max_tokens=2)).finished  # still serving


def test_leaving_a_stream_early_frees_the_worker(cluster, client: Client) -> None:
    # "held-": held on the worker after its first deltas, so still running when the client leaves.
    for i, _ in enumerate(client.generate_stream(list(range(20, 60)), SamplingParams(max_tokens=200, ignore_eos=True),
                                                 request_id="held-leaver")):
        if i == 2:
            break
    s = _wait_worker_idle(cluster[0])
    assert s.num_running == 0 and s.num_kv_blocks_used == 0


def test_abort_and_list_workers(cluster, client: Client) -> None:
    stream = client.generate_stream([3, 3, 3], SamplingParams(max_tokens=240, ignore_eos=True), request_id="c-abort")
    next(stream)
    assert client.abort("c-abort") == ["c-abort"]
    rest = list(stream)
    assert rest and rest[-1].finished and rest[-1].finish_reason == "abort"
    workers = client.list_workers()
    assert [w.worker_id for w in workers] == ["cw0"] and workers[0].healthy
    assert client.list_workers("prefill") == []


def test_async_client(cluster) -> None:
    async def main():
        async with AsyncClient(cluster[1].ready["grpc"], timeout=60) as c:
            result = await c.generate(IDS, GREEDY)
            streamed = [t async for d in c.generate_stream(IDS, GREEDY) for t in d.token_ids]
            assert streamed == result.token_ids and len(streamed) == 10
            with pytest.raises(ClientError) as e:
                await c.generate([10**6], GREEDY)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert [w.worker_id for w in await c.list_workers()] == ["cw0"]
    asyncio.run(main())


def test_cli_generate_through_the_router(cluster) -> None:
    r = subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "generate", "--router", cluster[1].ready["grpc"],
                        "--prompt", "Hello", "--max-tokens", "4"], capture_output=True, text=True, timeout=60,
                       cwd=pathlib.Path(__file__).parent)
    assert r.returncode == 0, r.stderr[-2000:]
