"""The router's aiohttp runner arguments take a request body as sent: no inflation of a
Content-Encoding on the event loop (the frontend refuses compressed bodies by name instead)."""

from __future__ import annotations

import asyncio
import gzip

import aiohttp
from aiohttp import web

from pdcluster.router.http_server import RUNNER_ARGS


async def _body_as_seen() -> tuple[bytes, bytes]:
    seen: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app, **RUNNER_ARGS)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        sent = gzip.compress(b'{"prompt": "' + b"a" * 100_000 + b'"}')
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/", data=sent,
                                    headers={"Content-Encoding": "gzip"}) as resp:
                assert resp.status == 200
        return sent, seen[0]
    finally:
        await runner.cleanup()


def test_runner_leaves_compressed_bodies_as_sent():
    sent, seen = asyncio.run(_body_as_seen())
    assert seen == sent  # with aiohttp's default (auto_decompress=True) the handler sees 100 kB inflated
