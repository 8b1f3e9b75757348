"""The encode role (encode_worker/): registered, encoder-only, refuses Generate legs; the Encode RPC's
status mapping (fake engines, milliseconds); only the router may call Encode under mTLS; the EC
connector's options default from the worker's own config."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.encode_worker import EncodeRole
from pdcluster.engine.ec_transfer_params import ECItemRef, ECTransferParams
from pdcluster.worker import encode_rpc
from pdcluster.worker.assembly import WorkerConfig, ec_connector_name, ec_connector_options
from pdcluster.worker.role_registry import resolve_role
from pdcluster.worker.roles import KvTransferRejected
from pdcluster.worker.server import worker_policy

HASH = "ab" * 32


def test_encode_role_is_registered_and_encoder_only() -> None:
    role = resolve_role("encode")
    assert role.encoder_only and role.default_ec_connector == "p2p_ec" and not role.needs_connector
    handler = role.make_handler()
    assert isinstance(handler, EncodeRole) and handler.proto_role == common_pb2.WORKER_ROLE_ENCODE
    for kv in (None, convert_kv(do_remote_decode=True)):
        with pytest.raises(KvTransferRejected, match="encode worker runs only the vision encoder"):
            handler.accept(kv)
    assert set(role.role_metrics({"ec_connector": {}, "num_kv_blocks_total": 1})) == {"ec_connector"}
    assert not resolve_role("prefill").encoder_only and resolve_role("prefill").default_ec_connector == ""


def convert_kv(**fields):
    from pdcluster.worker import convert

    return convert.kv_params_from_proto(common_pb2.KvTransferParams(**fields))


def test_ec_connector_options_default_from_the_worker() -> None:
    role = resolve_role("encode")
    config = WorkerConfig(role="encode", host="127.0.0.1", worker_id="encode-0", key_dir="/k", key_name="encode-0")
    assert ec_connector_name(config, role) == "p2p_ec"
    assert ec_connector_options(config, role) == {"role": "producer", "host": "127.0.0.1", "port": 0, "keys_dir": "/k",
                                                  "key_name": "encode-0", "engine_id": "encode-0"}
    given = WorkerConfig(role="encode", ec_connector_options={"port": 7000, "lease_s": 5})
    assert ec_connector_options(given, role)["port"] == 7000
    off = WorkerConfig(role="encode", ec_connector="", ec_connector_options={"port": 1})
    with pytest.raises(ValueError, match="without an EC connector"):
        ec_connector_options(off, role)
    assert ec_connector_options(WorkerConfig(role="prefill"), resolve_role("prefill")) == {}
    decode = ec_connector_options(WorkerConfig(role="decode", ec_connector="p2p_ec"), resolve_role("decode"))
    assert decode["role"] == "consumer"


def test_only_the_router_may_encode() -> None:
    assert worker_policy().allowed["/pdcluster.v1.Worker/Encode"] == {"router"}


class _Engine:
    is_healthy = True

    def ec_endpoint(self):
        return ("127.0.0.1:1", b"k")

    def __init__(self, result=None, error: BaseException | None = None, delay: float = 0.0) -> None:
        self.result, self.error, self.delay, self.calls = result, error, delay, []

    async def encode(self, request_id: str, images: list[bytes]) -> ECTransferParams:
        self.calls.append((request_id, images))
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return self.result


def _encode(engine, images=(b"png",), timeout=None, draining=False):
    req = worker_pb2.EncodeRequest(request_id="r1", images=list(images))
    return asyncio.run(encode_rpc.encode(engine, req, request_id="r1", timeout_s=timeout, draining=draining))


def _code(engine, **kw) -> grpc.StatusCode:
    with pytest.raises(encode_rpc.EncodeRefused) as e:
        _encode(engine, **kw)
    return e.value.code


def test_encode_rpc_returns_the_params_and_maps_failures() -> None:
    params = ECTransferParams(connector="p2p_ec", producer_id="encode-0", address="127.0.0.1:9", expires_at=5.0,
                              items=(ECItemRef(HASH, lease_id="l", nbytes=64, num_tokens=4),))
    engine = _Engine(params)
    resp = _encode(engine, images=(b"a", b"b"))
    assert resp.ec_transfer_params.items[0].mm_hash == HASH and engine.calls == [("r1", [b"a", b"b"])]
    assert _code(object()) == grpc.StatusCode.UNIMPLEMENTED  # an engine without encode()
    consumer_only = _Engine(params)
    consumer_only.ec_endpoint = lambda: None
    assert _code(consumer_only) == grpc.StatusCode.UNIMPLEMENTED
    assert _code(_Engine(error=NotImplementedError("no vision tower"))) == grpc.StatusCode.UNIMPLEMENTED
    assert _code(_Engine(params), images=()) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(_Engine(params), draining=True) == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(encode_rpc.EncodeRefused, match=r"images\[0\]") as e:
        _encode(_Engine(error=ValueError("multi_modal_data['image'][0] is not a decodable image")))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(_Engine(params, delay=5.0), timeout=0.01) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _code(_Engine(error=RuntimeError("boom"))) == grpc.StatusCode.INTERNAL
