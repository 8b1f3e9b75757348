"""The router's worker channels follow its TLS files (issue 16, item 7): a channel reads its
certificate, key and CA bundle once, so after `keys reissue` / `keys rotate-ca` / `keys
revoke-ca` a channel made before would keep presenting the old certificate (refused once the
worker drops the old CA) or trusting a revoked CA. The registry's probe asks `stamp()` each
health period (a stat of three files); when it differs from the stamp a handle's client was
built under, the registry builds a new client (new channel: a new handshake with the current
files) and retires the old one once the requests on it are done.

    probe -> rebuild_if_changed(handle)   new WorkerClient, handle.client swapped (new requests)
                                          old client: closed when it has no active request
                                          (or after grace_s: the request deadline bound)

A torn reissue (new key, old certificate) makes the new client fail to build: the old one stays
and the next probe tries again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from pdcluster.worker.tls import TLSConfig

log = logging.getLogger(__name__)
_RETIRE_POLL_S = 0.5


def stamp(tls: TLSConfig | None) -> tuple[tuple[int, int, int], ...] | None:
    """(inode, mtime, size) of the TLS files; None without TLS or when one is missing now."""
    if tls is None:
        return None
    out = []
    for path in (tls.ca, tls.cert, tls.key):
        if path is None:
            continue
        try:
            st = os.stat(path)
        except OSError:
            return None  # mid-rename or removed: keep the current client
        out.append((st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


class ChannelRebuilder:
    """Rebuilds a handle's WorkerClient when the TLS files changed since it was made."""

    def __init__(self, tls: TLSConfig | None, make_client: Callable[[str], Any], grace_s: float) -> None:
        self.tls = tls
        self._make = make_client
        self._grace_s = grace_s
        self._retiring: dict[asyncio.Task, Any] = {}  # retiring task -> the old client
        self.rebuilds = 0

    def current(self) -> tuple[tuple[int, int, int], ...] | None:
        return stamp(self.tls)

    def rebuild_if_changed(self, handle: Any) -> bool:
        now = self.current()
        if self.tls is None or now is None or now == handle.tls_stamp:
            return False
        try:
            client = self._make(handle.address)
        except (OSError, ValueError) as e:  # a torn pair: keep the old channel, retry next probe
            log.warning("worker %s: TLS files changed but cannot be loaded yet: %s", handle.address, e)
            return False
        old, handle.client, handle.tls_stamp = handle.client, client, now
        self.rebuilds += 1
        log.info("worker %s: TLS files changed, new channel (the old one closes when idle)", handle.address)
        task = asyncio.get_running_loop().create_task(self._retire(old), name=f"retire-{handle.address}")
        self._retiring[task] = old
        task.add_done_callback(lambda t: self._retiring.pop(t, None))
        return True

    async def _retire(self, client: Any) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._grace_s
        while client.num_active and loop.time() < deadline:
            await asyncio.sleep(_RETIRE_POLL_S)
        await client.close()

    async def close(self) -> None:
        """Close the clients still retiring (the router stops)."""
        retiring = dict(self._retiring)
        for t in retiring:
            t.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in retiring.values()), return_exceptions=True)


class HttpsCertReloader:
    """The HTTPS frontend's certificate follows its files: an ssl.SSLContext serves what it was
    loaded with, so check() (the router calls it every health period) reloads a reissued pair
    into the same context, which the listening socket uses for every new handshake. The pair is
    checked to match first and loaded from one private copy, so a torn reissue is never
    half-loaded (OpenSSL would keep the new certificate with the old key)."""

    def __init__(self, ctx: Any, tls: TLSConfig) -> None:
        self.ctx = ctx
        self.tls = TLSConfig(cert=tls.cert, key=tls.key)
        self._stamp = stamp(self.tls)
        self.reloads = 0

    def check(self) -> bool:
        import tempfile

        from pdcluster.security.rotation import matching_pair

        now = stamp(self.tls)
        if now is None or now == self._stamp:
            return False
        try:
            key_pem, cert_pem = matching_pair(str(self.tls.cert), str(self.tls.key))
        except (OSError, ValueError) as e:
            log.warning("HTTPS certificate changed but cannot be loaded yet: %s", e)
            return False
        with tempfile.TemporaryDirectory(prefix="pdcluster-https-") as d:  # 0700
            path = os.path.join(d, "pair.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(cert_pem + b"\n" + key_pem)
            self.ctx.load_cert_chain(path)
        self._stamp = now
        self.reloads += 1
        log.info("HTTPS certificate reloaded from %s", self.tls.cert)
        return True
