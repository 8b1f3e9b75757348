"""Helper process for the tests: serves one shared-memory region filled with a known pattern.

Key comes from $TEST_TRANSFER_KEY (hex). Prints one JSON line, then serves until stdin closes.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from pdcluster.transfer import TransferServer, alloc_region

if __name__ == "__main__":
    size = int(sys.argv[1])
    region = alloc_region(size, shared=True)
    region.as_numpy()[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)  # byte i == i % 256
    server = TransferServer(bytes.fromhex(os.environ["TEST_TRANSFER_KEY"])).start()
    rid = server.register(region)
    print(json.dumps({"port": server.address[1], "region_id": rid, "shm_name": region.shm_name}), flush=True)
    sys.stdin.read()  # the test closes our stdin to stop us
    server.stop()
    region.close()
