from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pdcluster.transfer import Region, alloc_region, as_byte_view, open_shared_region
from pdcluster.transfer.region import shm_dir


def test_private_region_views() -> None:
    r = alloc_region(4096)
    assert r.shm_name is None and r.nbytes == 4096
    t = r.as_tensor(torch.float32, (4, 8), offset=128)
    t.fill_(1.5)
    assert r.as_numpy(np.float32, (4, 8), offset=128).sum() == 48.0
    with pytest.raises(ValueError):
        r.as_tensor(torch.float32, (2000,))


def test_shared_region_is_mapped_by_a_peer_and_unlinked_by_its_owner() -> None:
    r = alloc_region(1 << 16, shared=True)
    path = os.path.join(shm_dir(), r.shm_name)
    assert os.stat(path).st_mode & 0o777 == 0o600
    r.as_numpy()[:10] = 7
    peer = open_shared_region(r.shm_name, writable=False, expected_nbytes=1 << 16)
    assert bytes(peer.view[:10]) == b"\x07" * 10 and peer.readonly
    with pytest.raises(TypeError):
        peer.view[0] = 1  # read-only mapping
    rw = open_shared_region(r.shm_name, writable=True)
    rw.view[20] = 9
    assert r.view[20] == 9
    peer.close()
    rw.close()
    assert os.path.exists(path)  # openers never unlink
    r.close()
    assert not os.path.exists(path)
    r.close()  # idempotent


def test_shared_names_are_validated() -> None:
    for bad in ("../etc/passwd", "pdcluster-../../x", "other-name", "pdcluster-a/b"):
        with pytest.raises(ValueError):
            open_shared_region(bad, writable=False)
    r = alloc_region(4096, shared=True)
    try:
        with pytest.raises(ValueError):
            open_shared_region(r.shm_name, writable=False, expected_nbytes=8192)
    finally:
        r.close()


def test_buffers_of_every_kind() -> None:
    t = torch.zeros(16, dtype=torch.bfloat16)  # numpy has no bfloat16: goes through uint8
    reg = Region.from_buffer(t)
    reg.view[:2] = b"\x80\x3f"  # bf16 1.0
    assert t[0].item() == 1.0
    assert Region.from_buffer(np.zeros(10, dtype=np.int64)).nbytes == 80
    assert Region.from_buffer(bytearray(5)).nbytes == 5
    with pytest.raises(ValueError):
        as_byte_view(b"readonly", writable=True)
    with pytest.raises(ValueError):
        as_byte_view(np.zeros((4, 4))[:, 1], writable=False)  # not contiguous


def test_region_cache_first_use_from_many_threads_never_breaks_a_copy() -> None:
    """Regression: threads that missed the cache together each mapped the segment, and the last
    one closed the mapping the others were copying through (a batch get's read then failed)."""
    import threading

    from pdcluster.transfer import SharedRegionCache

    owner = alloc_region(1 << 20, shared=True)
    owner.as_numpy()[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
    try:
        for _ in range(20):  # the race needs the first use of a segment: start over each round
            cache = SharedRegionCache()
            barrier = threading.Barrier(8)
            errors: list[BaseException] = []

            def copy(cache: SharedRegionCache = cache, barrier: threading.Barrier = barrier,
                     errors: list[BaseException] = errors) -> None:
                barrier.wait()
                try:
                    region = cache.get(owner.shm_name, owner.nbytes, writable=False)
                    for _ in range(20):
                        out = bytearray(region.view[: 1 << 16])
                        assert out == bytes(owner.view[: 1 << 16])
                except BaseException as e:  # noqa: BLE001 - collected and asserted below
                    errors.append(e)

            threads = [threading.Thread(target=copy) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            cache.close()
            assert errors == []
    finally:
        owner.close()


def test_segments_of_killed_owners_are_reaped_and_live_ones_kept() -> None:
    """A SIGKILLed owner cannot unlink its segment; the next process that makes one removes it,
    and never a segment whose owner still runs."""
    import signal
    import subprocess
    import sys

    from pdcluster.transfer.region import reap_orphaned_segments

    code = ("import sys, time; from pdcluster.transfer import alloc_region; r = alloc_region(1 << 16, shared=True); "
            "print(r.shm_name, flush=True); time.sleep(120)")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        names = [p.stdout.readline().strip() for p in procs]  # type: ignore[union-attr]
        paths = [os.path.join(shm_dir(), n) for n in names]
        assert all(os.path.exists(p) for p in paths)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        assert os.path.exists(paths[0])  # the leak this guards against
        mine = alloc_region(4096, shared=True)  # our own live segment must survive the reap too
        try:
            gone = reap_orphaned_segments()
            assert names[0] in gone and not os.path.exists(paths[0])
            assert names[1] not in gone and os.path.exists(paths[1])  # its owner is alive
            assert os.path.exists(os.path.join(shm_dir(), mine.shm_name))
        finally:
            mine.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    assert not os.path.exists(paths[1]) or names[1] in reap_orphaned_segments()


def test_a_folder_under_the_segment_prefix_is_skipped_and_the_reap_goes_on(tmp_path) -> None:
    """A 0700 folder of ours in the shm directory (serve/up keep key folders there, named
    pdcluster-tls-*) is not a segment: the reap leaves it and still removes the orphans after it
    (unlinking it raised IsADirectoryError and ended the whole reap)."""
    import signal
    import subprocess
    import sys
    import tempfile

    from pdcluster.transfer.region import reap_orphaned_segments

    folder = tempfile.mkdtemp(prefix="pdcluster-aaa-", dir=shm_dir())  # sorts before most segment names
    code = ("from pdcluster.transfer import alloc_region; r = alloc_region(1 << 12, shared=True); "
            "print(r.shm_name, flush=True); import time; time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()  # type: ignore[union-attr]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        gone = reap_orphaned_segments()
        assert name in gone and not os.path.exists(os.path.join(shm_dir(), name))
        assert os.path.isdir(folder) and os.path.basename(folder) not in gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.rmdir(folder)
