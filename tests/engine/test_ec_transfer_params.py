"""ECTransferParams: validation names the field; the proto round trip keeps every value."""

from __future__ import annotations

import pytest

from pdcluster.engine.ec_transfer_params import (
    MAX_EC_ITEMS,
    MAX_EC_PRODUCERS,
    ECItemRef,
    ECTransferParams,
    check_ec_params_list,
)
from pdcluster.proto_convert import ec_params_from_proto, ec_params_to_proto

H1, H2 = "a" * 64, "0123456789abcdef" * 4


def _params(**kw):
    base = dict(connector="p2p_ec", producer_id="enc0", address="127.0.0.1:5555", public_key=b"k" * 32,
                fingerprint="fp", engine_epoch=7, expires_at=1.5e9,
                items=(ECItemRef(H1, "lease-1", 4096, 576), ECItemRef(H2)))
    base.update(kw)
    return ECTransferParams(**base)


def test_wire_and_proto_round_trip():
    p = _params()
    assert ECTransferParams.from_wire(p.to_wire()) == p
    assert ec_params_from_proto(ec_params_to_proto(p)) == p
    assert p.item(H2) == ECItemRef(H2) and p.item("b" * 64) is None


@pytest.mark.parametrize("kw, field", [
    (dict(items=(ECItemRef(H1), ECItemRef(H1))), "items"),
    (dict(public_key=b"x" * 65), "public_key"),
    (dict(engine_epoch=-1), "engine_epoch"),
    (dict(expires_at=float("nan")), "expires_at"),
    (dict(address="x" * 2000), "address"),
    (dict(items=tuple(ECItemRef(f"{i:064x}") for i in range(MAX_EC_ITEMS + 1))), "items"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"ec_transfer_params\.{field}"):
        _params(**kw)


@pytest.mark.parametrize("mm_hash", ["A" * 64, "a" * 63, "../etc", ""])
def test_mm_hash_must_be_sha256_hex(mm_hash):
    with pytest.raises(ValueError, match=r"items\.mm_hash"):
        ECItemRef(mm_hash)


def test_from_wire_refuses_unknown_fields_and_bad_items():
    with pytest.raises(ValueError, match=r"ec_transfer_params\.evil"):
        ECTransferParams.from_wire({"evil": 1})
    with pytest.raises(ValueError, match=r"items\.x"):
        ECTransferParams.from_wire({"items": [{"mm_hash": H1, "x": 1}]})
    with pytest.raises(ValueError, match=r"items\.mm_hash"):
        ECTransferParams.from_wire({"items": [{"lease_id": "l"}]})
    with pytest.raises(ValueError, match="at most"):
        check_ec_params_list([{}] * (MAX_EC_PRODUCERS + 1))
    assert check_ec_params_list([_params().to_wire()]) == (_params(),)
