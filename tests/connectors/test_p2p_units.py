"""Pure pieces of the connector layer: leases, block ranges, TP completion counting, options,
params checks, the registry."""

from __future__ import annotations

import pytest
import torch

from pdcluster.connectors import create_connector, resolve_connector_class
from pdcluster.connectors.p2p.blocks import (
    CacheGeometry,
    block_ranges,
    chunk_block_ids,
    copy_blocks,
    paired_runs,
)
from pdcluster.connectors.p2p.lease import LeaseError, LeaseTable
from pdcluster.connectors.p2p.options import P2POptions, check_endpoint
from pdcluster.connectors.p2p.params import check_consumer_params
from pdcluster.engine.connector_hooks import TransferCompletion
from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.kv_connector import KVTransferParams
from pdcluster.engine.request import Request
from pdcluster.sampling_params import SamplingParams
from pdcluster.security.keys import generate_keypair, keypair_to_string


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_leases_expire_in_any_order_and_end_exactly_once() -> None:
    clock = Clock()
    table = LeaseTable(ttl_s=10.0, clock=clock)
    for i in range(3):
        clock.t = 100.0 + i
        table.add(f"r{i}", f"{i:032x}", f"{i + 10:032x}", [i])
    clock.t = 105.0
    assert table.renew(f"{10:032x}", f"{0:032x}")  # r0 now expires at 115, after r1 and r2
    assert not table.renew(f"{10:032x}", f"{1:032x}")  # wrong transfer: no renewal
    clock.t = 113.5
    assert sorted(table.expire()) == ["r1", "r2"]
    assert table.take_finished() == {"r1", "r2"}
    assert table.release(f"{11:032x}", f"{1:032x}", "r1") == "expired"  # late done: expired, not freed twice
    with pytest.raises(LeaseError, match="wrong_request"):
        table.lookup(f"{10:032x}", f"{0:032x}", "r9")
    assert table.release(f"{10:032x}", f"{0:032x}", "r0") == "released"
    assert table.release(f"{10:032x}", f"{0:032x}", "r0") == "released"  # remembered, not re-ended
    assert table.take_finished() == {"r0"} and table.take_finished() == set()
    assert table.counts == {"created": 3, "released": 1, "expired": 2, "aborted": 0}


def test_a_lookup_after_expiry_never_serves_even_before_the_scan() -> None:
    clock = Clock()
    table = LeaseTable(ttl_s=1.0, clock=clock)
    table.add("r", "a" * 32, "b" * 32, [3])
    clock.t += 1.5
    with pytest.raises(LeaseError, match="expired"):
        table.lookup("b" * 32, "a" * 32, "r")
    assert table.take_finished() == {"r"} and table.expire() == []
    with pytest.raises(LeaseError, match="unknown"):
        table.lookup("c" * 32, "a" * 32)


def test_block_ranges_merge_runs_and_copy_matches_indexing() -> None:
    geo = CacheGeometry(num_layers=2, num_blocks=6, block_nbytes=8)
    assert block_ranges(geo, [1, 2, 4]) == [(8, 16), (32, 8), (56, 16), (80, 8), (104, 16), (128, 8),
                                            (152, 16), (176, 8)]
    assert paired_runs([1, 2, 4], [0, 1, 2]) == [(1, 0, 2), (4, 2, 1)]
    assert chunk_block_ids(list(range(10)), num_layers=2, max_ranges=8) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    src = torch.arange(2 * 2 * 6 * 2, dtype=torch.float32).view(2, 2, 6, 2)  # block_nbytes = 2 floats
    dst = torch.zeros(2, 2, 5, 2)
    n = copy_blocks(geo, memoryview(src.numpy()).cast("B"), CacheGeometry(2, 5, 8), memoryview(dst.numpy()).cast("B"),
                    [1, 2, 4], [3, 0, 1])
    assert n == 2 * 2 * 3 * 8
    assert torch.equal(dst[:, :, [3, 0, 1]], src[:, :, [1, 2, 4]])
    with pytest.raises(ValueError, match="outside"):
        block_ranges(geo, [6])


def test_completion_is_counted_over_ranks() -> None:
    c = TransferCompletion(world_size=2)
    c.add(0, {"a", "b"}, {"x"}, {7})
    assert c.take() == (set(), set(), {7})  # a failed block is reported at once
    c.add(1, {"a"}, set(), set())
    assert c.take() == ({"a"}, set(), set())
    c.add(1, {"b"}, {"x"}, set())
    assert c.take() == ({"b"}, {"x"}, set())
    with pytest.raises(ValueError):
        c.add(2, set(), set(), set())


def _options(**kw: object) -> dict:
    kp = generate_keypair("x")
    return {"keypair": keypair_to_string(kp), "allowed_keys": [kp.public.decode()], **kw}


class _Cfg:
    kv_role = "both"


def test_options_are_checked() -> None:
    opts = P2POptions.from_dict(_options(lease_ttl_s=2, transport="shm"), _Cfg())  # type: ignore[arg-type]
    assert opts.lease_ttl_s == 2.0 and opts.is_producer and opts.is_consumer
    with pytest.raises(ValueError, match="CURVE keys"):
        P2POptions.from_dict({}, _Cfg())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown p2p connector option"):
        P2POptions.from_dict(_options(lease_tll=3), _Cfg())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        P2POptions.from_dict(_options(peers={"p": {"endpoint": "ipc:///tmp/x", "public_key": b"0" * 32}}),
                             _Cfg())  # type: ignore[arg-type]
    for bad in ("inproc://x", "tcp://*:5", "tcp://h:0", "tcp://h", "tcp://h:99999"):
        with pytest.raises(ValueError):
            check_endpoint(bad)
    assert check_endpoint("tcp://10.0.0.1:5555") == "tcp://10.0.0.1:5555"


def _request(prompt: list[int], block_size: int = 4) -> Request:
    req = Request("r", prompt, SamplingParams(max_tokens=4))
    KVCacheManager(16, block_size, True, 256).update_block_hashes(req)
    return req


def test_consumer_params_must_describe_this_prompt() -> None:
    req = _request(list(range(10)))
    good = {"producer_id": "p", "transfer_id": "a" * 32, "lease_id": "b" * 32, "engine_epoch": 5, "block_size": 4,
            "num_tokens": 10, "block_ids": [7, 8, 9], "block_hashes": list(req.block_hashes[:2])}
    check_consumer_params(KVTransferParams(**good), req, 4)
    for change, field in [({"num_tokens": 11}, "num_tokens"), ({"block_size": 8}, "block_size"),
                          ({"block_ids": [1, 2]}, "block_ids"), ({"transfer_id": "../etc"}, "transfer_id"),
                          ({"block_hashes": list(_request(list(range(1, 11))).block_hashes[:2])}, "block_hashes"),
                          ({"engine_epoch": True}, "engine_epoch")]:
        with pytest.raises(ValueError, match=field):
            check_consumer_params(KVTransferParams(**{**good, **change}), req, 4)


def test_registry_names_dotted_paths_and_errors() -> None:
    assert resolve_connector_class("p2p").__name__ == "P2PConnector"
    assert resolve_connector_class("pdcluster.connectors.p2p:P2PConnector").__name__ == "P2PConnector"
    with pytest.raises(ValueError, match="available: .*p2p"):
        resolve_connector_class("nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_connector_class("no_such_module_x:Thing")
    with pytest.raises(ValueError, match="has no attribute"):
        resolve_connector_class("pdcluster.connectors.p2p:Nope")
    with pytest.raises(ValueError, match="KVConnectorRole"):
        create_connector("p2p", "sideways", None, {})  # type: ignore[arg-type]


def test_params_survive_the_router_proto_and_stay_signed() -> None:
    from pdcluster.connectors.p2p.options import P2POptions, PeerEntry
    from pdcluster.connectors.p2p.params import build_params
    from pdcluster.connectors.p2p.peer import resolve_producer
    from pdcluster.proto_convert import kv_params_from_proto, kv_params_to_proto

    kp = generate_keypair("producer")
    req = _request(list(range(10)))
    meta = {"producer_id": "p1", "epoch": (1 << 62) - 1, "tp_size": 1, "data_host": "127.0.0.1", "data_port": 5,
            "handshake_endpoint": "tcp://127.0.0.1:6000", "public_key": kp.public}
    params = build_params(req, [7, 8, 9], 4, meta, "a" * 32, "b" * 32, 30.0, b"k" * 32)
    back = kv_params_from_proto(kv_params_to_proto(params))
    for key in params.to_wire():  # every field the producer set (proto3 leaves zero values out)
        value = getattr(params, key)
        assert getattr(back, key) == pytest.approx(value) if key == "lease_expiry_time" \
            else getattr(back, key) == value, key
    opts = P2POptions(engine_id="c", kv_role="consumer", keypair=kp, allowed_keys={"p": kp.public},
                      params_secret=b"k" * 32)
    assert resolve_producer(back, opts).endpoint == "tcp://127.0.0.1:6000"
    tampered = back.replace(handshake_endpoint="tcp://10.9.9.9:6000")
    with pytest.raises(Exception, match="not signed"):
        resolve_producer(tampered, opts)
    registry = P2POptions(engine_id="c", kv_role="consumer", keypair=kp, allowed_keys={"p": kp.public},
                          peers={"p1": PeerEntry("tcp://127.0.0.1:7000", kp.public)})
    assert resolve_producer(tampered, registry).endpoint == "tcp://127.0.0.1:7000"  # the registry wins


def test_dropping_an_aborted_requests_lease_ends_it_once() -> None:
    table = LeaseTable(ttl_s=60.0, clock=Clock())
    table.add("r", "a" * 32, "b" * 32, [3, 4])
    table.add("s", "c" * 32, "d" * 32, [5])
    assert table.drop_request("r") and not table.drop_request("r")  # ends once
    assert table.take_finished() == {"r"} and table.take_finished() == set()
    with pytest.raises(LeaseError, match="aborted"):
        table.lookup("b" * 32, "a" * 32, "r")  # a reader that comes anyway is refused
    assert table.release("b" * 32, "a" * 32, "r") == "aborted"  # its "done" proves nothing
    assert table.num_active == 1 and table.counts["aborted"] == 1
