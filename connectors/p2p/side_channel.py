"""SideChannelServer: the producer's CURVE ROUTER socket (handshake, open, heartbeat, done) and the
thread that serves it: pdcluster.security.curve_service's CurveRouterService (fail-closed ZAP
allow-list, MAXMSGSIZE, rotation with the key folder, revoked sessions dropped) with
ProducerAgent.handle as its handler, which size- and schema-checks every message. The same thread
runs the lease expiry scan every EXPIRY_SCAN_S: expiry never waits for traffic.
"""

from __future__ import annotations

from pdcluster.security.curve_service import CurveRouterService

from .agent import ProducerAgent
from .options import P2POptions
from .wire import MAX_FRAME_BYTES

EXPIRY_SCAN_S = 0.05
_SOCKET_NAME = "p2p-side-channel"


class SideChannelServer(CurveRouterService):
    TICK_S = EXPIRY_SCAN_S

    def __init__(self, agent: ProducerAgent, opts: P2POptions) -> None:
        self.agent = agent
        super().__init__(name=_SOCKET_NAME, keypair=opts.keypair, allowed_keys=opts.allowed_keys,
                         bind=opts.side_channel_bind, max_frame_bytes=MAX_FRAME_BYTES, keys_dir=opts.keys_dir,
                         advertise_host=opts.advertise_host,
                         wildcard_error="side_channel_bind is a wildcard address: set advertise_host")
        self.endpoint = f"tcp://{self.address}"

    def handle(self, frames: list[bytes], sender: str | None) -> list[bytes]:
        # sender: the ZAP User-Id, against which lease operations are checked
        return self.agent.handle(frames, sender=sender)

    def tick(self) -> None:
        self.agent.leases.expire()
