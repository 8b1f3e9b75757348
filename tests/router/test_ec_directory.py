"""EcDirectory (router/ec_directory.py): encoder affinity by image bytes, held encodings shared between
workers, dropped on lease expiry and when their producer goes away; bounded. Pure, microseconds."""

from __future__ import annotations

import pytest

from pdcluster._proto import common_pb2
from pdcluster.engine.ec_transfer_params import MAX_EC_PRODUCERS
from pdcluster.router.ec_directory import MAX_PRODUCERS_PER_IMAGE, EcDirectory, image_keys

A, B, C = image_keys([b"image-a", b"image-b", b"image-c"])


def _params(producer: str, expires_at: float = 100.0, n: int = 1) -> common_pb2.EcTransferParams:
    p = common_pb2.EcTransferParams(connector="p2p_ec", producer_id=producer, expires_at=expires_at)
    for i in range(n):
        p.items.add(mm_hash=f"{i:064x}", lease_id=f"{producer}-{i}", nbytes=64, num_tokens=4)
    return p


def _always(address: str, epoch: int) -> bool:
    return True


def test_image_keys_are_sha256_of_the_bytes_in_prompt_order() -> None:
    import hashlib

    assert image_keys([b"x", b"y", b"x"]) == [hashlib.sha256(b).hexdigest() for b in (b"x", b"y", b"x")]


def test_encoder_affinity_then_least_loaded() -> None:
    d = EcDirectory()
    encoders = [("e0:1", 3), ("e1:1", 0), ("e2:1", 0)]
    assert d.pick_encoder([A], encoders) == "e1:1"  # nobody encoded A: least loaded, then address
    d.record_encoded([A], "e0:1")
    assert d.pick_encoder([A], encoders) == "e0:1"  # where A's encoding already is, despite its load
    d.record_encoded([B, C], "e2:1")
    assert d.pick_encoder([A, B, C], encoders) == "e2:1"  # the one holding most of the request's images
    assert d.pick_encoder([A], [("e1:1", 0)]) == "e1:1"  # the holder is not a candidate (down)
    assert d.pick_encoder([A], []) is None
    d.forget("e0:1")
    assert d.pick_encoder([A], encoders) == "e1:1"


def test_shared_params_of_live_producers_only() -> None:
    d = EcDirectory(lease_margin_s=1.0)
    d.record_held([A, B], _params("p0"), "p0:1", epoch=7)
    d.record_held([A], _params("p1", expires_at=50.0), "p1:1", epoch=3)
    got = d.shared([A], now=10.0, live=_always)
    assert [p.producer_id for p in got] == ["p0", "p1"]  # newest lease first
    assert [p.producer_id for p in d.shared([B], now=10.0, live=_always)] == ["p0"]
    assert d.shared([C], now=10.0, live=_always) == []
    assert [p.producer_id for p in d.shared([A], 10.0, _always, exclude={"p0:1"})] == ["p1"]
    # a lease about to end (within the margin) is as good as gone, and is dropped
    assert [p.producer_id for p in d.shared([A], now=49.5, live=_always)] == ["p0"]
    assert [p.producer_id for p in d.shared([A], now=10.0, live=_always)] == ["p0"]
    # the producer went away or restarted (live says no for that epoch): dropped for good
    assert d.shared([A, B], now=10.0, live=lambda addr, epoch: epoch != 7) == []
    assert len(d) == 0
    # params without items are not recorded
    d.record_held([A], common_pb2.EcTransferParams(producer_id="p2"), "p2:1", epoch=1)
    assert d.shared([A], now=0.0, live=_always) == []


def test_a_newer_lease_replaces_the_producers_old_one_and_forget_drops_it() -> None:
    d = EcDirectory()
    d.record_held([A], _params("p0", expires_at=20.0), "p0:1", epoch=1)
    d.record_held([A], _params("p0", expires_at=90.0), "p0:1", epoch=1)
    got = d.shared([A], now=0.0, live=_always)
    assert len(got) == 1 and got[0].expires_at == 90.0
    d.forget("p0:1")
    assert d.shared([A], now=0.0, live=_always) == [] and len(d) == 0


def test_bounds() -> None:
    d = EcDirectory(max_images=2)
    keys = image_keys([bytes([i]) for i in range(5)])
    for i, key in enumerate(keys):
        d.record_held([key], _params(f"p{i}"), f"p{i}:1", epoch=1)
        d.record_encoded([key], f"e{i}:1")
    assert len(d) == 2 and d.shared([keys[0]], 0.0, _always) == []  # LRU: the oldest images went first
    assert d.pick_encoder([keys[0]], [("e0:1", 5), ("e9:1", 0)]) == "e9:1"
    assert d.pick_encoder([keys[4]], [("e4:1", 5), ("e9:1", 0)]) == "e4:1"
    many = EcDirectory()
    for i in range(MAX_PRODUCERS_PER_IMAGE + 2):
        many.record_held([A], _params(f"p{i}"), f"p{i}:1", epoch=1)
    assert len(many.shared([A], 0.0, _always)) == MAX_PRODUCERS_PER_IMAGE
    wide = EcDirectory()
    for i in range(MAX_EC_PRODUCERS + 3):
        key = image_keys([b"k%d" % i])[0]
        wide.record_held([key], _params(f"p{i}"), f"p{i}:1", epoch=1)
    all_keys = image_keys([b"k%d" % i for i in range(MAX_EC_PRODUCERS + 3)])
    assert len(wide.shared(all_keys, 0.0, _always)) == MAX_EC_PRODUCERS  # a request's bound
    with pytest.raises(ValueError, match="max_images"):
        EcDirectory(max_images=0)
