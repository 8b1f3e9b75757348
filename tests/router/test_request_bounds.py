"""Issue 16 on the router's gRPC frontend, in front of real workers: bounded request data (each
refusal INVALID_ARGUMENT naming the field and the limit), and the API key (UNAUTHENTICATED
without it; the health service stays open)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdcluster._proto import common_pb2, router_pb2
from pdcluster.client import Client, ClientError
from pdcluster.sampling_params import SamplingParams

SP = common_pb2.SamplingParams


def gen(stub, metadata=None, **kw) -> list[router_pb2.GenerateResponse]:
    kw.setdefault("prompt_token_ids", router_pb2.TokenIds(ids=[5, 6, 7]))
    kw.setdefault("sampling_params", SP(max_tokens=1))
    return list(stub.Generate(router_pb2.GenerateRequest(**kw), timeout=30, metadata=metadata))


BOUNDED = [
    ({"sampling_params": SP(max_tokens=1, stop_token_ids=list(range(65)))}, "stop_token_ids", "64"),
    ({"sampling_params": SP(max_tokens=1, stop_token_ids=list(range(100_000)))}, "stop_token_ids", "64"),
    ({"sampling_params": SP(max_tokens=1, stop_token_ids=[10**6])}, "stop_token_ids", "out of range"),
    ({"sampling_params": SP(max_tokens=1, stop=["s"] * 33)}, "stop", "32"),
    ({"sampling_params": SP(max_tokens=1, stop=["s" * 1025])}, "stop", "1024"),
    ({"sampling_params": SP(max_tokens=1, logprobs=21)}, "logprobs", "20"),
    ({"sampling_params": SP(max_tokens=1, n=4)}, "n", "1"),
    ({"prompt_token_ids": router_pb2.TokenIds(ids=[1] * 300)}, "prompt_token_ids", "256"),
]


@pytest.mark.parametrize("kw,field,limit", BOUNDED, ids=[b[1] + str(i) for i, b in enumerate(BOUNDED)])
def test_bounded_fields(cluster, kw, field, limit):
    c = cluster(1)
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field) and limit in e.value.details(), e.value.details()
    assert gen(c.stub)[-1].finished


def test_stop_token_ids_limit_is_configurable(cluster):
    c = cluster(1, max_stop_token_ids=4)
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub, sampling_params=SP(max_tokens=1, stop_token_ids=[1, 2, 3, 4, 5]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 4" in e.value.details()
    assert gen(c.stub, sampling_params=SP(max_tokens=1, stop_token_ids=[1, 2, 3, 4]))[-1].finished


def test_logprob_volume_is_bounded_by_the_message_limit(cluster):
    """Logprobs that travel in one message (a prompt's; a whole answer's when not streamed) stay
    within max_message_bytes: above it, INVALID_ARGUMENT naming the field and the limit; a
    streamed answer's come a step at a time and are not limited so."""
    c = cluster(1, max_message_bytes=64 << 10)  # 1,365 values of 48 bytes
    budget = (64 << 10) // 48
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub, prompt_token_ids=router_pb2.TokenIds(ids=[5] * 100), sampling_params=SP(max_tokens=1, prompt_logprobs=20))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("prompt_logprobs") and str(budget) in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub, sampling_params=SP(max_tokens=100, logprobs=20, ignore_eos=True), stream=False)
    assert e.value.details().startswith("logprobs") and str(budget) in e.value.details()
    out = gen(c.stub, sampling_params=SP(max_tokens=100, logprobs=20, ignore_eos=True), stream=True)
    assert sum(len(r.logprobs) for r in out) == 100
    out = gen(c.stub, prompt_token_ids=router_pb2.TokenIds(ids=[5] * 60), sampling_params=SP(max_tokens=1, prompt_logprobs=20))
    assert len(out[0].prompt_logprobs) == 59


def test_worker_replies_may_exceed_the_client_message_limit():
    """A worker's reply is taken up to the workers' own send limit: one long answer above the
    client-facing max_message_bytes must not fail the multiplexed stream and eject the worker
    (measured before: RESOURCE_EXHAUSTED on the stream, the worker ejected, every request 503)."""
    from pdcluster.router.worker_client import WORKER_REPLY_BYTES, channel_options
    from pdcluster.worker.options import DEFAULT_MAX_MESSAGE_BYTES

    options = dict(channel_options(64 << 10))
    assert options["grpc.max_receive_message_length"] == WORKER_REPLY_BYTES >= DEFAULT_MAX_MESSAGE_BYTES
    assert options["grpc.max_send_message_length"] == 64 << 10


def test_invalid_params_are_not_cached(cluster):
    c = cluster(1)
    for i in range(50):
        with pytest.raises(grpc.RpcError):
            gen(c.stub, sampling_params=SP(max_tokens=1, stop_token_ids=list(range(i, i + 5000))))
    assert c.router.preprocessor.params_cache_bytes < 16 << 10


def test_api_key_on_grpc(cluster):
    c = cluster(1, api_key="k-123")
    address = c.router.grpc_address
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for wrong in ("Bearer k-12", "k-123", "Bearer k-1234", "bearer k-123"):
        with pytest.raises(grpc.RpcError) as e:
            gen(c.stub, metadata=(("authorization", wrong),))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, wrong
    assert gen(c.stub, metadata=(("authorization", "Bearer k-123"),))[-1].finished
    with pytest.raises(grpc.RpcError) as e:
        c.stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The standard health service stays open (load balancers probe it without credentials).
    health = health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with Client(address, timeout=30, api_key="k-123") as client:
        assert len(client.generate([5, 6, 7], params).token_ids) == 2
        assert len(list(client.generate_stream([5, 6], params))) >= 1
        assert client.list_workers()
    with Client(address, timeout=30, api_key="nope") as client, pytest.raises(ClientError) as ce:
        client.generate([5, 6, 7], params)
    assert ce.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(address, timeout=30) as client, pytest.raises(ClientError) as ce:
        client.generate([5, 6, 7], params)
    assert ce.value.code == grpc.StatusCode.UNAUTHENTICATED
