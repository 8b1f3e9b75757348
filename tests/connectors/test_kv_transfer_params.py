"""KVTransferParams: validated at construction (errors name the field), bounded extra, wire round trips."""

from __future__ import annotations

import msgpack
import pytest

from pdcluster.connectors import KVTransferParams
from pdcluster.connectors.p2p.params import P2PExtra
from pdcluster.connectors.store.meta import StoreHandoff
from pdcluster.engine.kv_transfer_params import MAX_EXTRA_ENTRIES, MAX_EXTRA_VALUE_BYTES
from pdcluster.proto_convert import kv_params_from_proto, kv_params_to_proto

FULL = KVTransferParams(
    do_remote_prefill=True, connector="p2p", request_id="r1", transfer_id="a" * 32, producer_id="p",
    producer_rank=1, producer_tp_size=2, engine_epoch=(1 << 64) - 1, block_ids=(0, 7, (1 << 32) - 1),
    block_hashes=(b"\x01" * 32,), num_tokens=40, block_size=16, remote_host="10.0.0.1", remote_port=5,
    handshake_endpoint="tcp://10.0.0.1:6", producer_public_key=b"k" * 40, lease_id="b" * 32,
    lease_expiry_time=1.5e9, transfer_token=b"t", store_keys=("k0",), extra={"x": "1", "n": [1, 2]})


def test_wire_and_proto_round_trips() -> None:
    assert KVTransferParams.from_wire(msgpack.unpackb(msgpack.packb(FULL.to_wire(), use_bin_type=True))) == FULL
    assert kv_params_from_proto(kv_params_to_proto(FULL)) == FULL
    assert KVTransferParams().to_wire() == {} and kv_params_to_proto(KVTransferParams()).ByteSize() == 0
    leg = FULL.for_decode_leg()
    assert leg.do_remote_prefill and not leg.do_remote_decode and leg.block_ids == FULL.block_ids


def test_frozen_and_lists_become_tuples() -> None:
    p = KVTransferParams(block_ids=[1, 2], extra={"l": [1, "a"]})
    assert p.block_ids == (1, 2) and p.extra["l"] == (1, "a")
    with pytest.raises(AttributeError):
        p.num_tokens = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.extra["y"] = "2"  # type: ignore[index]


@pytest.mark.parametrize("fields, named", [
    ({"num_tokens": -1}, "num_tokens"), ({"engine_epoch": True}, "engine_epoch"),
    ({"block_ids": [1, -2]}, "block_ids"), ({"block_ids": 3}, "block_ids"),
    ({"do_remote_decode": 1}, "do_remote_decode"), ({"producer_id": 5}, "producer_id"),
    ({"producer_public_key": "text"}, "producer_public_key"), ({"lease_expiry_time": float("nan")}, "lease_expiry_time"),
    ({"store_keys": ["ok", 3]}, "store_keys"), ({"block_hashes": ["ab"]}, "block_hashes"),
    ({"extra": {"bad key": "1"}}, "extra"), ({"extra": {"k": {"nested": 1}}}, r"extra\['k'\]"),
    ({"extra": {"k": [[1]]}}, r"extra\['k'\]"), ({"extra": {"k": "x" * (MAX_EXTRA_VALUE_BYTES + 1)}}, r"extra\['k'\]"),
    ({"extra": {f"k{i}": i for i in range(MAX_EXTRA_ENTRIES + 1)}}, "extra"), ({"extra": {"k": 1 << 64}}, r"extra\['k'\]"),
    ({"zzz": 1}, "unknown field.*'zzz'"),
])
def test_malformed_fields_are_refused_by_name(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=f"kv_transfer_params.*{named}"):
        KVTransferParams.from_wire(fields)


def test_connector_parts_of_extra() -> None:
    p2p = KVTransferParams(extra=P2PExtra("s" * 64, '[["tcp://h:1", 3]]').into({"plugin": 1}))
    assert P2PExtra.of(p2p) == P2PExtra("s" * 64, '[["tcp://h:1", 3]]') and p2p.extra["plugin"] == 1
    assert P2PExtra.of(KVTransferParams()) == P2PExtra()
    with pytest.raises(ValueError, match="p2p_sig"):
        P2PExtra.of(KVTransferParams(extra={"p2p_sig": 3}))
    store = KVTransferParams(connector="store", extra=StoreHandoff("ns/model", "ff").into({}))
    assert StoreHandoff.of(kv_params_from_proto(kv_params_to_proto(store))) == StoreHandoff("ns/model", "ff")
    assert StoreHandoff.of(KVTransferParams()) is None
    # On the wire both stay plain strings under their keys, as before the params were typed.
    assert dict(kv_params_to_proto(store).extra) == {"store_key_prefix": "ns/model", "store_last_hash": "ff"}
