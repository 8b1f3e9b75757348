"""`pdcluster serve-worker --tp 2`: a real worker with a child rank answers Generate with the TP=1
tokens; when its child rank dies, health turns NOT_SERVING and Generate is UNAVAILABLE; SIGTERM
then stops the worker, and nothing it started is left."""

from __future__ import annotations

import os
import signal
import time

import grpc
from distributed.tp_procs import alive, children_of, wait_dead
from grpc_health.v1 import health_pb2, health_pb2_grpc
from workers.worker_process import start_worker

from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc

PROMPTS = [[5, 6, 7, 8, 9], [42, 17, 300, 2, 11, 99, 4]]


def gen_request(ids: list[int], max_tokens: int = 8) -> worker_pb2.WorkerGenerateRequest:
    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return worker_pb2.WorkerGenerateRequest(prompt_token_ids=ids, stream=True, sampling_params=sp)


def health(ch: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_tp2_worker_generates_and_fails_cleanly(tiny_ckpt, started_pids, tmp_path) -> None:
    from pdcluster import LLM, SamplingParams

    path = tiny_ckpt("qwen3", num_key_value_heads=1)
    ref = LLM(path, num_kv_blocks=48).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8,
                                                                       ignore_eos=True))
    worker = start_worker(["--model", path, "--tp", "2", "--num-kv-blocks", "48", "--log-level", "WARNING"],
                          tmp_path, timeout=120)
    started_pids.append(worker.proc.pid)
    try:
        ranks = children_of(worker.proc.pid)
        started_pids.extend(ranks)
        assert len(ranks) == 1, ranks
        with grpc.insecure_channel(worker.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            assert health(ch) == health_pb2.HealthCheckResponse.SERVING
            calls = [stub.Generate(gen_request(p), timeout=60) for p in PROMPTS]
            for call, r in zip(calls, ref):
                assert [t for resp in call for t in resp.token_ids] == r.outputs[0].token_ids

            os.kill(ranks[0], signal.SIGKILL)
            end = time.monotonic() + 10.0
            while health(ch) == health_pb2.HealthCheckResponse.SERVING and time.monotonic() < end:
                time.sleep(0.1)
            assert health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
            try:
                list(stub.Generate(gen_request(PROMPTS[0]), timeout=30))
                raise AssertionError("Generate succeeded on a worker whose TP rank is dead")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        assert worker.stop(20) == 0
    finally:
        worker.stop(5)
    assert not alive(worker.proc.pid) and wait_dead(ranks, 10.0) == []
