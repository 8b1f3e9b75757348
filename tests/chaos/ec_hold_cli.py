"""`python tests/chaos/ec_hold_cli.py ARGS` is `pdcluster ARGS` with two test hooks for encoder chaos:

    $PDCLUSTER_TEST_EC_HOLD_DIR=DIR   every AsyncEngine.encode first writes DIR/started-<pid>-<n>, then
                                      waits while DIR/hold exists: a test signals the encoder while
                                      it is inside an Encode, however fast the machine is
    $PDCLUSTER_TEST_EC_DATA=HOST:PORT the p2p_ec producer announces HOST:PORT as its data address and
                                      writes the port its TransferServer really bound to DIR/data-port
                                      (DIR: the hold folder): a FaultProxy listening at HOST:PORT and
                                      forwarding there sits on the EC data plane, across restarts (a
                                      fixed bind port could meet its own TIME_WAIT). The control port
                                      has the connector's `port` and `advertise_host` options for that.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import runpy
import sys
from typing import Any

HOLD_ENV = "PDCLUSTER_TEST_EC_HOLD_DIR"
DATA_ENV = "PDCLUSTER_TEST_EC_DATA"


def install_encode_hold(folder: str) -> None:
    from pdcluster.engine.async_engine import AsyncEngine

    real = AsyncEngine.encode
    calls = itertools.count()

    async def encode(self: Any, request_id: str, images: Any) -> Any:
        with open(os.path.join(folder, f"started-{os.getpid()}-{next(calls)}"), "w") as f:
            f.write(request_id)
        while os.path.exists(os.path.join(folder, "hold")):
            await asyncio.sleep(0.01)
        return await real(self, request_id, images)

    AsyncEngine.encode = encode  # type: ignore[method-assign]


def install_data_address(address: str, folder: str) -> None:
    from pdcluster.connectors.ec import producer

    host, _, port = address.rpartition(":")
    real_init = producer.ECProducer.__init__

    def init(self: Any, *args: Any, **kw: Any) -> None:
        real_init(self, *args, **kw)
        bound = self.data_address[1]
        with open(os.path.join(folder, "data-port.new"), "w") as f:
            f.write(str(bound))
        os.replace(os.path.join(folder, "data-port.new"), os.path.join(folder, "data-port"))
        self.data_address = (host, int(port))

    producer.ECProducer.__init__ = init  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m pdcluster.cluster.cli` has it, not tests/chaos/
    if os.environ.get(HOLD_ENV):
        install_encode_hold(os.environ[HOLD_ENV])
    if os.environ.get(DATA_ENV):
        install_data_address(os.environ[DATA_ENV], os.environ[HOLD_ENV])
    runpy.run_module("pdcluster.cluster.cli", run_name="__main__", alter_sys=True)
