"""P2P lease operations are checked against the authenticated sender (issue 16, item 2): the
first consumer to open a lease owns it; another allow-listed key (a different worker of the same
cluster) knowing the lease's ids can neither open, renew nor end it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdcluster.connectors.p2p.agent import ProducerAgent
from pdcluster.connectors.p2p.blocks import CacheGeometry
from pdcluster.connectors.p2p.options import P2POptions
from pdcluster.connectors.p2p.peer import ChannelPool, Producer, call
from pdcluster.connectors.p2p.side_channel import SideChannelServer
from pdcluster.connectors.p2p.wire import DONE, HEARTBEAT, OPEN
from pdcluster.security.keys import generate_keypair
from pdcluster.transfer import Region

GEO = CacheGeometry(num_layers=2, num_blocks=8, block_nbytes=1024)
FP = {"model": "m", "dtype": "float32", "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64,
      "block_size": 4, "layout": "NHD", "connector_version": 1, "body_version": 1}
PRODUCER, OWNER, OTHER = (generate_keypair(n) for n in ("producer", "decode-0", "decode-1"))
ALLOWED = {kp.name: kp.public for kp in (PRODUCER, OWNER, OTHER)}
LEASE = {"request_id": "req", "transfer_id": "a" * 32, "lease_id": "1" * 32}


def _opts(kp: Any, role: str) -> P2POptions:
    return P2POptions(engine_id=f"t-{kp.name}", kv_role=role, keypair=kp, allowed_keys=ALLOWED, request_timeout_s=3.0)


@pytest.fixture()
def producer() -> Any:
    opts = _opts(PRODUCER, "producer")
    agent = ProducerAgent(opts, FP, GEO, Region.from_buffer(torch.zeros(GEO.nbytes // 4)), None)
    side = SideChannelServer(agent, opts)
    agent.add_lease(LEASE["request_id"], LEASE["transfer_id"], LEASE["lease_id"], [0, 1])
    yield agent, Producer("t-producer", side.endpoint, PRODUCER.public)
    side.close()
    agent.close()


def test_only_the_owner_uses_a_lease(producer: Any) -> None:
    agent, prod = producer
    owner, other = ChannelPool(_opts(OWNER, "consumer")), ChannelPool(_opts(OTHER, "consumer"))
    try:
        assert call(owner, prod, OPEN, {**LEASE, "first_block": 0})["ok"]
        reply = call(other, prod, OPEN, {**LEASE, "first_block": 0})
        assert not reply["ok"] and "wrong_owner" in reply["error"]
        ref = {"lease_id": LEASE["lease_id"], "transfer_id": LEASE["transfer_id"]}
        assert call(other, prod, HEARTBEAT, {"leases": [ref]})["alive"] == []
        assert call(owner, prod, HEARTBEAT, {"leases": [ref]})["alive"] == [LEASE["lease_id"]]
        done = call(other, prod, DONE, {**LEASE, "ok": True})
        assert not done["ok"] and done["status"] == "wrong_owner"
        assert agent.leases.num_active == 1  # the stranger ended nothing
        assert call(owner, prod, DONE, {**LEASE, "ok": True})["status"] == "released"
        stats = agent.stats()
        assert stats["p2p_refused_lease_wrong_owner"] == 1 and stats["p2p_refused_done_wrong_owner"] == 1
    finally:
        owner.close()
        other.close()
