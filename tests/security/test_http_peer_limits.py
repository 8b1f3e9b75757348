"""Per-peer caps on the router's HTTP frontend (issue 16, item 8): real aiohttp server on
127.0.0.1 with router/peer_limits.py installed as the router installs it. A peer over its
connection cap gets a 503 on the new connection (nothing of it parsed); over its request cap a
429 naming the limit; both counted. Requests are held by an event, never by timing."""

from __future__ import annotations

import asyncio
import json

from aiohttp import ClientSession, web
from prometheus_client import CollectorRegistry

from pdcluster.router.peer_limits import PeerLimits


async def _serve(limits: PeerLimits, release: asyncio.Event, entered: list) -> tuple[web.AppRunner, str]:
    async def slow(request: web.Request) -> web.Response:
        entered.append(1)
        await release.wait()
        return web.json_response({"ok": True})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[limits.middleware()])
    app.router.add_post("/v1/completions", slow)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    limits.install(runner.server)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _until(cond) -> None:
    for _ in range(2400):  # bounds a hang only (2 min); ends as soon as cond holds
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


def _count(registry: CollectorRegistry, limit: str) -> float:
    return registry.get_sample_value("pdcluster_router_peer_limit_refusals_total", {"limit": limit}) or 0.0


def test_request_cap_per_peer() -> None:
    async def run() -> None:
        reg = CollectorRegistry()
        limits, release, entered = PeerLimits(100, 2, reg), asyncio.Event(), []
        runner, url = await _serve(limits, release, entered)
        try:
            async with ClientSession() as s:
                held = [asyncio.ensure_future(s.post(url + "/v1/completions", json={})) for _ in range(2)]
                await _until(lambda: len(entered) == 2)
                async with s.post(url + "/v1/completions", json={}) as r:
                    body = await r.json()
                    assert r.status == 429 and r.headers["Retry-After"] == "1"
                    assert "max_http_requests_per_peer" in body["error"]["message"]
                    assert body["error"]["type"] == "RateLimitError"
                async with s.get(url + "/health") as r:  # probes are not counted
                    assert r.status == 200
                assert _count(reg, "requests") == 1
                release.set()
                for f in held:
                    assert (await f).status == 200
                async with s.post(url + "/v1/completions", json={}) as r:  # places freed
                    assert r.status == 200
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_connection_cap_per_peer() -> None:
    async def run() -> None:
        reg = CollectorRegistry()
        limits = PeerLimits(2, 100, reg)
        runner, url = await _serve(limits, asyncio.Event(), [])
        port = int(url.rsplit(":", 1)[1])
        conns = []
        try:
            for _ in range(2):
                conns.append(await asyncio.open_connection("127.0.0.1", port))
            await _until(lambda: limits.open_connections("127.0.0.1") == 2)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            raw = await reader.read()  # the server writes its 503 and closes
            head, _, body = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503")
            assert "max_http_connections_per_peer" in json.loads(body)["error"]["message"]
            writer.close()
            assert _count(reg, "connections") == 1
            conns.pop()[1].close()
            await _until(lambda: limits.open_connections("127.0.0.1") == 1)
            _, w2 = await asyncio.open_connection("127.0.0.1", port)  # a place again
            conns.append((None, w2))
            await _until(lambda: limits.open_connections("127.0.0.1") == 2)
            assert _count(reg, "connections") == 1
        finally:
            for _, w in conns:
                w.close()
            await runner.cleanup()

    asyncio.run(run())


def test_frontend_puts_the_cap_after_the_api_key() -> None:
    from pdcluster.router.config import RouterConfig
    from pdcluster.router.http_server import HttpFrontend
    from pdcluster.router.metrics import RouterMetrics

    cfg = RouterConfig(api_key="k", max_http_requests_per_peer=3)
    assert cfg.http_requests_per_peer == 3 and cfg.http_connections_per_peer == cfg.max_inflight + 64
    assert RouterConfig().http_requests_per_peer > RouterConfig().max_inflight  # global cap answers first
    limits = PeerLimits(1, 1, CollectorRegistry())
    app = HttpFrontend(cfg, None, None, None, RouterMetrics(), admission=object(),  # type: ignore[arg-type]
                       peer_limits=limits).app()
    names = [getattr(m, "__name__", "") for m in app.middlewares]
    assert names[-1] == "per_peer_requests" and len(names) == 4 and names[-2] == "_identity_encoding"
