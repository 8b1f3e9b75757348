"""`pdcluster serve-worker` start and stop: config errors fail fast, SIGTERM aborts what runs and
exits 0."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys

import grpc
from workers.worker_process import start_worker

from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "serve-worker", *args],
                          capture_output=True, text=True, timeout=60)


def test_config_errors_fail_fast(tmp_path: pathlib.Path) -> None:
    r = _cli("--key-dir", str(tmp_path / "nope"))
    assert r.returncode == 2 and "public-key folder" in r.stderr and r.stdout == ""
    r = _cli("--tls-ca", str(tmp_path / "ca.pem"))
    assert r.returncode == 2 and "--tls-ca needs" in r.stderr


def test_sigterm_aborts_streams_and_exits_zero(demo_model: str, key_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    wp = start_worker(["--role", "decode", "--model", demo_model, "--max-model-len", "256", "--no-prefix-caching",
                       "--key-dir", str(key_dir)], tmp_path, hold=True)
    try:
        assert wp.ready["role"] == "decode" and wp.ready["kv_events_endpoint"]  # sockets to close at exit
        with grpc.insecure_channel(wp.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            call = stub.Generate(worker_pb2.WorkerGenerateRequest(
                request_id="held-long", prompt_token_ids=[3, 4, 5], stream=True,  # held: running at SIGTERM
                sampling_params=common_pb2.SamplingParams(max_tokens=240, ignore_eos=True)), timeout=60)
            next(call)
            wp.proc.send_signal(signal.SIGTERM)
            try:
                last = list(call)[-1]
                assert last.finished and last.finish_reason == common_pb2.FINISH_REASON_ABORT
            except grpc.RpcError as e:  # the connection may close before the last message lands
                assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert wp.proc.wait(30) == 0, wp.stderr_tail()
    finally:
        wp.stop()
