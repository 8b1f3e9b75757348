"""A TP=2 worker opens nothing beyond loopback: the rendezvous store (torch's TCPStore listens on
every interface when given a port; ours gets a socket pre-bound to 127.0.0.1) and gloo's pair
listeners, in the worker and in its child rank, from /proc."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from proc_sockets import listening, non_loopback
from workers.worker_process import start_worker


def _descendants(root: int) -> list[int]:
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier}
        found += sorted(frontier)
    return found


@pytest.fixture
def tp2_worker(tmp_path):
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen3", tmp_path / "ckpt", dtype=torch.float32, num_key_value_heads=1)
    worker = start_worker(["--model", path, "--tp", "2", "--num-kv-blocks", "48", "--log-level", "WARNING"],
                          tmp_path, timeout=120)
    pids = [worker.proc.pid, *_descendants(worker.proc.pid)]
    try:
        yield worker, pids
    finally:
        if worker.proc.poll() is None:
            worker.stop(20)
        for pid in pids:  # ranks left behind by a failed stop: ours, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_tp_group_listens_on_loopback_only(tp2_worker) -> None:
    worker, pids = tp2_worker
    assert len(pids) >= 2, "the worker has no child rank"
    ports = listening(pids)
    # The worker's gRPC port and the rendezvous store at least.
    assert len(ports) >= 2, ports
    assert non_loopback(pids) == []


def test_make_store_refuses_a_non_loopback_host() -> None:
    from pdcluster.distributed.group import make_store

    with pytest.raises((ValueError, OSError)):
        make_store("0.0.0.0", 0, 2, True, 5.0)
    store = make_store("127.0.0.1", 0, 1, True, 5.0)
    store.set("k", "v")
    assert listening([os.getpid()]).get(("127.0.0.1", store.port)) == os.getpid()
    assert ("0.0.0.0", store.port) not in listening([os.getpid()])


def _generate(address: str) -> list[int]:
    import grpc

    from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc

    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    req = worker_pb2.WorkerGenerateRequest(prompt_token_ids=[5, 6, 7, 8], stream=True, sampling_params=sp)
    with grpc.insecure_channel(address) as ch:
        return [t for resp in worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=60) for t in resp.token_ids]


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_gloo_listeners_take_no_new_connections(tp2_worker) -> None:
    """gloo keeps an fd for every connection its listener accepts, for ever (and aborts when
    accept fails): once the group is connected its listeners drop new connections, so peers that
    connect in a loop cost a rank nothing, and the group keeps working."""
    import socket

    worker, pids = tp2_worker
    before = _generate(worker.address)
    assert len(before) == 6
    child = pids[1]
    ports = [port for (addr, port), pid in listening([child]).items() if pid == child]
    assert ports, "the child rank has no gloo listener"
    fds = _fds(child)
    for port in ports:
        for _ in range(5):
            s = socket.socket()
            s.settimeout(0.3)  # loopback answers a SYN at once; a dropped SYN is never answered
            try:
                assert s.connect_ex(("127.0.0.1", port)) != 0, f"a new connection reached gloo's listener on {port}"
            finally:
                s.close()
    assert _fds(child) == fds
    assert _generate(worker.address) == before
