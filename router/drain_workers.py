"""Drain every worker a router knows, at once, before a cluster is taken down (`pdcluster down`).

Each worker gets Worker.Drain(timeout_s): NOT_SERVING, new requests refused, the running ones
finish (their tokens still flow through this router to the clients) until the timeout, the rest
end with UNAVAILABLE. Called through the router because under mutual TLS only the router's
certificate may call Drain (pdcluster/worker/server.py ROUTER_ONLY), and the router has a channel
to every worker already. With every worker draining there is nowhere to migrate to: what is left
at the timeout ends with a clear error, as the whole cluster is going away.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pdcluster._proto import worker_pb2

DRAIN_RPC_MARGIN_S = 30.0  # the RPC's deadline beyond the drain's own timeout


async def drain_workers(registry: Any, timeout_s: float) -> dict[str, dict[str, Any]]:
    """address -> {"finished": n, "moved": m} (or {"error": "..."}) for every registered worker."""
    handles = list(registry.handles)

    async def one(handle: Any) -> dict[str, Any]:
        try:
            r = await handle.client.stub.Drain(worker_pb2.DrainRequest(timeout_s=timeout_s),
                                               timeout=timeout_s + DRAIN_RPC_MARGIN_S)
        except grpc.aio.AioRpcError as e:  # a dead worker has nothing to drain
            return {"error": f"{e.code().name}: {e.details()}"}
        return {"finished": r.num_finished, "moved": r.num_moved}

    results = await asyncio.gather(*(one(h) for h in handles))
    return {h.address: r for h, r in zip(handles, results)}
