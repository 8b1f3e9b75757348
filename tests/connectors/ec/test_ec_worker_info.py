"""WorkerInfo (GetInfo) names the worker's EC connector and, where it produces, its EC endpoint
(host:port + CURVE public key): built from a real engine with p2p_ec on a tiny LLaVA."""

from __future__ import annotations

from pdcluster._proto import common_pb2
from pdcluster.worker.worker_stats import KVEventsInfo, build_info


def test_worker_info_carries_the_ec_endpoint(engines, llava_path, ec_keys) -> None:
    producer = engines(llava_path, encoder_only=True, ec_connector="p2p_ec",
                       ec_connector_options=ec_keys.options("encoder", role="producer"))
    info = build_info("encode-0", common_pb2.WORKER_ROLE_ENCODE, producer, 1, KVEventsInfo(), "", "test")
    address, key = producer.ec_endpoint()
    assert info.ec_connector == "p2p_ec" and info.ec_endpoint == address and info.ec_public_key == key
    assert address.startswith("127.0.0.1:") and key == ec_keys.pairs["encoder"].public
    consumer = engines(llava_path, ec_connector="p2p_ec",
                       ec_connector_options=ec_keys.options("prefill", role="consumer"))
    info = build_info("decode-0", common_pb2.WORKER_ROLE_DECODE, consumer, 1, KVEventsInfo(), "", "test")
    assert info.ec_connector == "p2p_ec" and not info.ec_endpoint and not info.ec_public_key  # consumes only
    plain = engines(llava_path)
    info = build_info("both-0", common_pb2.WORKER_ROLE_BOTH, plain, 1, KVEventsInfo(), "", "test")
    assert not info.ec_connector and not info.ec_endpoint
