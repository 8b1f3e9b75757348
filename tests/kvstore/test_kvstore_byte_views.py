"""kvstore/byte_views.py: the short path for contiguous CPU tensors gives the same bytes, shares
the caller's memory and refuses what as_byte_view refuses; and a MACed store round trip of
tensors of several dtypes through it (real master and node processes)."""

from __future__ import annotations

import secrets
import time

import numpy as np
import pytest
import torch

from pdcluster.kvstore import KVStoreClient, Status
from pdcluster.kvstore.byte_views import byte_view, byte_views
from pdcluster.transfer import as_byte_view


@pytest.mark.parametrize("tensor", [
    torch.arange(4096, dtype=torch.uint8),
    torch.arange(3 * 512, dtype=torch.bfloat16).reshape(3, 512),
    torch.arange(1024, dtype=torch.float32).reshape(2, 8, 64),
    torch.arange(64 * 100, dtype=torch.uint8).view(64, 100)[5],  # a row: offset into its storage
    torch.empty(0, dtype=torch.float16),
])
def test_same_bytes_as_as_byte_view_and_shared(tensor: torch.Tensor) -> None:
    fast, ref = byte_view(tensor, writable=True), as_byte_view(tensor, writable=True)
    assert (fast.format, fast.ndim, fast.nbytes, fast.readonly) == ("B", 1, ref.nbytes, False)
    assert fast.tobytes() == ref.tobytes()
    if fast.nbytes:
        fast[0] = (fast[0] + 1) % 256  # writes land in the caller's tensor
        assert as_byte_view(tensor, writable=False)[0] == fast[0]


def test_other_buffers_go_through_as_byte_view() -> None:
    arr = np.arange(100, dtype=np.int32)
    assert byte_views([arr, bytearray(b"abc")], writable=True)[0].tobytes() == arr.tobytes()
    assert byte_view(b"abc", writable=False).tobytes() == b"abc"
    with pytest.raises(ValueError):
        byte_view(b"abc", writable=True)  # read-only


def test_refuses_what_as_byte_view_refuses() -> None:
    strided = torch.arange(100, dtype=torch.uint8)[::2]
    with pytest.raises(ValueError):
        byte_view(strided, writable=False)
    with pytest.raises(ValueError):
        byte_view(torch.zeros(4, 4).t(), writable=True)
    grad = torch.ones(8, requires_grad=True)  # numpy() refuses it; as_byte_view takes it, so do we
    assert byte_view(grad, writable=False).tobytes() == as_byte_view(grad, writable=False).tobytes()


def test_tensor_round_trip_with_object_mac(procs) -> None:
    _, addr = procs.master("--port", "0")
    procs.node(addr, "n0", "32M")
    key = secrets.token_bytes(32)
    with KVStoreClient(addr, object_key=key) as c:
        deadline = time.monotonic() + 60
        while c.stats()["nodes"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        srcs = [torch.randn(16, 64, dtype=torch.bfloat16), torch.randint(0, 255, (4096,), dtype=torch.uint8),
                torch.randn(300 << 10 >> 2)]  # the last one is above the arena limit: two-phase put
        keys = [f"bv-{i}" for i in range(len(srcs))]
        assert c.batch_put(keys, srcs) == [Status.OK] * len(srcs)
        dests = [torch.zeros_like(s) for s in srcs]
        assert c.batch_get(keys, dests) == [s.numel() * s.element_size() for s in srcs]
        for s, d in zip(srcs, dests, strict=True):
            assert torch.equal(s, d)
        assert c.counters["mac_mismatches"] == 0
