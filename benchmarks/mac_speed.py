"""Per-core speed of the data plane's payload MACs, on one buffer size at a time.

    .venv/bin/python benchmarks/mac_speed.py

AES-256-GMAC (what P2P READs use: pdcluster.transfer.gmac, the bytes as GCM additional data) and
keyed BLAKE3 (FLAG_MAC, pdcluster.transfer.integrity) over 256 MiB in calls of 64 KiB .. 64 MiB:
best of three, GB/s on one thread. This is the hash alone; what P2P pays per byte beside it
(syscalls, copies, set-up per window) is `pdcluster bench transfer`'s to measure.
"""

from __future__ import annotations

import os
import time

import blake3
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

TOTAL = 256 << 20


def _gmac(buf: memoryview, reps: int) -> None:
    enc = Cipher(algorithms.AES(os.urandom(32)), modes.GCM(os.urandom(12))).encryptor()
    for _ in range(reps):
        enc.authenticate_additional_data(buf)
    enc.finalize()


def _blake3(buf: memoryview, reps: int) -> None:
    h = blake3.blake3(key=os.urandom(32))
    for _ in range(reps):
        h.update(buf)
    h.digest()


def main() -> None:
    print(f"{'call size':>10} {'GMAC GB/s':>10} {'BLAKE3 GB/s':>12}")
    for size in (64 << 10, 256 << 10, 1 << 20, 64 << 20):
        buf = memoryview(bytearray(os.urandom(size)))
        reps = max(1, TOTAL // size)
        row = []
        for fn in (_gmac, _blake3):
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                fn(buf, reps)
                best = min(best, time.perf_counter() - t0)
            row.append(reps * size / best / 1e9)
        print(f"{size >> 10:>7} KiB {row[0]:>10.2f} {row[1]:>12.2f}")


if __name__ == "__main__":
    main()
