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
