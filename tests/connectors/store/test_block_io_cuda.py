"""block_io on CUDA, called from a thread that never set the device (the store worker's load
thread unpacks there): the kernels must run on the cache's device. A new thread's current CUDA
device is 0 and Triton launches on the current device, so TP rank r's cache on cuda:r needs the
guard in block_io. Needs CUDA (skipped without it); the cross-device case needs two GPUs."""

from __future__ import annotations

import threading

import pytest
import torch

from pdcluster.connectors.store.block_io import pack_all, shard_objects, unpack_blocks
from pdcluster.connectors.store.layout import StoreLayout

pytestmark = pytest.mark.gpu
L, H, N, C, NB = 2, 4, 16, 32, 8


def _round_trip_in_a_new_thread(device: torch.device) -> None:
    lay = StoreLayout(model_id="cuda-io", num_layers=L, total_num_kv_heads=H, head_dim=C, block_size=N,
                      kv_dtype="bfloat16", itemsize=2, store_tp_size=2, layout="LBNHC")
    cache = torch.randn(L, 2, NB, N, H, C, device=device).to(torch.bfloat16)
    out = torch.zeros_like(cache)
    slots = torch.zeros(3, lay.object_nbytes, dtype=torch.uint8)  # host staging, as the worker's
    objs = shard_objects(slots, lay, torch.bfloat16)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            pack_all(cache, [4, 1, 3], objs, lay, 2, 4)  # shard 1: local heads [2, 4)
            unpack_blocks(objs, out, [0, 5, 2], lay, 2, 4)
            torch.cuda.synchronize(device)
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    ref = torch.zeros_like(slots)
    pack_all(cache.cpu(), [4, 1, 3], shard_objects(ref, lay, torch.bfloat16), lay, 2, 4)
    assert torch.equal(ref, slots)  # the same bytes as the CPU reference
    assert torch.equal(out[:, :, [0, 5, 2], :, 2:4].cpu(), cache[:, :, [4, 1, 3], :, 2:4].cpu())
    assert not out[:, :, :, :, :2].any()  # other heads untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pack_unpack_from_another_thread() -> None:
    _round_trip_in_a_new_thread(torch.device("cuda", 0))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_pack_unpack_from_another_thread_on_the_second_gpu() -> None:
    _round_trip_in_a_new_thread(torch.device("cuda", 1))
