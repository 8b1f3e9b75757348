"""ECControlServer: the producer's CURVE ROUTER socket and the thread that serves it:
pdcluster.security.curve_service's CurveRouterService (fail-closed ZAP allow-list, MAXMSGSIZE,
rotation with the key folder, revoked sessions dropped) with ECProducer.handle as its handler, which
size- and schema-checks every message, so garbage, pickles, oversize and replayed frames get an
error reply and the thread keeps serving. The same thread runs the lease expiry scan every
EXPIRY_SCAN_S, so expiry never waits for traffic.
"""

from __future__ import annotations

from pdcluster.security.curve_service import CurveRouterService

from .options import ECOptions
from .producer import ECProducer
from .wire import MAX_FRAME_BYTES

EXPIRY_SCAN_S = 0.05
SOCKET_NAME = "ec-control"


class ECControlServer(CurveRouterService):
    TICK_S = EXPIRY_SCAN_S

    def __init__(self, producer: ECProducer, opts: ECOptions) -> None:
        self.producer = producer
        super().__init__(name=SOCKET_NAME, keypair=opts.keypair, allowed_keys=opts.allowed_keys,
                         bind=f"tcp://{opts.host}:{opts.port or '*'}", max_frame_bytes=MAX_FRAME_BYTES,
                         keys_dir=opts.keys_dir, advertise_host=opts.advertise_host,
                         wildcard_error="p2p_ec host is a wildcard address: set advertise_host")

    def handle(self, frames: list[bytes], sender: str | None) -> list[bytes]:
        return self.producer.handle(frames, sender=sender)

    def tick(self) -> None:
        self.producer.store.expire()
