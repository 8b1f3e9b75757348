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

The HTTPS frontend (HttpsCertReloader) follows its certificate, key and client-CA bundle: see
the class for how a changed bundle, a removed CA included, reaches new handshakes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import tempfile
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


def https_server_context(certfile: str, keyfile: str | None = None, ca: str | None = None) -> ssl.SSLContext:
    """The HTTPS frontend's context: its certificate (key in keyfile, or in certfile after the
    certificate), and with `ca` a client certificate required, signed by a CA of that bundle."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile)
    if ca:
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _bundle(path: str) -> list[Any]:
    """The CA certificates of a PEM bundle (ValueError when it holds none)."""
    from cryptography import x509

    with open(path, "rb") as f:
        cas = x509.load_pem_x509_certificates(f.read())
    if not cas:
        raise ValueError(f"{path}: no certificate")
    return cas


def _issued_by_any(der: bytes, cas: list[Any]) -> bool:
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    leaf = x509.load_der_x509_certificate(der)
    for ca in cas:
        try:
            leaf.verify_directly_issued_by(ca)
            return True
        except (InvalidSignature, ValueError, TypeError):  # another issuer's name, key or key type
            continue
    return False


class HttpsCertReloader:
    """The HTTPS frontend follows its TLS files: check() (the router calls it every health
    period) reloads a reissued certificate/key and, with mutual TLS, a changed client-CA bundle.

    Certificate/key: loaded into the listening context, which serves every new handshake. The
    pair is checked to match first and loaded from one private copy, so a torn reissue is never
    half-loaded (OpenSSL would keep the new certificate with the old key).

    Client-CA bundle: load_verify_locations only adds to a context's trust store, so a removed
    CA would stay trusted. Instead each change builds a fresh context (pair + current bundle) and
    the listening context's SNI callback, which OpenSSL runs in every ClientHello (with or
    without a server name), moves the new handshake onto it (SSL_set_SSL_CTX: certificate and
    trust store of the fresh context; verify mode is CERT_REQUIRED in both). The asyncio server
    keeps its listening socket and context; live connections are not re-verified.

    Session resumption: the session cache and ticket keys stay the listening context's, and a
    resumed session is not verified again, so a client of a removed CA could resume a session it
    got before. So once the bundle changed, install()'s connection hook closes a resumed
    connection whose certificate no CA of the current bundle issued (counted resumed_refused).
    That check knows direct issuers only: a resumed session of a leaf under an intermediate CA
    that is not itself in the bundle is closed too (full handshakes verify chains as always).
    """

    def __init__(self, ctx: ssl.SSLContext, tls: TLSConfig) -> None:
        self.ctx = ctx
        self.tls = TLSConfig(cert=tls.cert, key=tls.key, ca=tls.ca)
        self._stamp = stamp(self.tls)
        self.reloads = 0
        self.ca_reloads = 0
        self.resumed_refused = 0
        self._serving = ctx  # the context new handshakes run on: ctx until the bundle changes
        self._ca_stamp = stamp(TLSConfig(ca=tls.ca)) if tls.ca else None
        self._cas: list[Any] | None = None  # the current bundle's CAs, once it changed
        if tls.ca:
            ctx.sni_callback = self._switch

    def _switch(self, sslobj: Any, server_name: str | None, ctx: ssl.SSLContext) -> None:
        serving = self._serving
        if serving is not ctx:
            sslobj.context = serving

    def check(self) -> bool:
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
            if self.tls.ca and not self._reload_bundle(path):
                return False
            self.ctx.load_cert_chain(path)
        self._stamp = now
        self.reloads += 1
        log.info("HTTPS certificate%s reloaded from %s", " and client-CA bundle" if self.tls.ca else "", self.tls.cert)
        return True

    def _reload_bundle(self, pair_path: str) -> bool:
        """A fresh context from the pair and the current bundle for new handshakes; False (the
        current one kept) while the bundle cannot be loaded (mid-write, empty, not PEM)."""
        ca = str(self.tls.ca)
        ca_stamp = stamp(TLSConfig(ca=ca))
        try:
            fresh = https_server_context(pair_path, None, ca)
            cas = _bundle(ca)
        except (OSError, ValueError, ssl.SSLError) as e:
            log.warning("HTTPS client-CA bundle %s changed but cannot be loaded yet: %s", ca, e)
            return False
        if ca_stamp != self._ca_stamp:  # (else only the pair changed: the same CAs)
            self._cas, self._ca_stamp = cas, ca_stamp
            self.ca_reloads += 1
        self._serving = fresh
        return True

    def admits(self, transport: Any) -> bool:
        """False for a resumed TLS session whose client certificate no CA of the current bundle
        issued (only once the bundle changed: before, OpenSSL's verification stands)."""
        cas = self._cas
        if cas is None:
            return True
        sslobj = transport.get_extra_info("ssl_object")
        if sslobj is None or not sslobj.session_reused:
            return True
        der = sslobj.getpeercert(binary_form=True)
        if der and _issued_by_any(der, cas):
            return True
        self.resumed_refused += 1
        log.warning("HTTPS peer %s refused: resumed a session whose client certificate the current CA bundle "
                    "does not trust", transport.get_extra_info("peername"))
        return False

    def install(self, server: Any) -> None:
        """Wrap the aiohttp web.Server's connection hook with admits() (mutual TLS only)."""
        if not self.tls.ca:
            return
        made = server.connection_made

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            if not self.admits(transport):
                transport.abort()
                return
            made(handler, transport)

        server.connection_made = connection_made


class HttpsReloadCollector:
    """The HTTPS reloader's counts on the router's /metrics (a prometheus_client collector)."""

    def __init__(self, reloader: HttpsCertReloader) -> None:
        self._reloader = reloader

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        r = self._reloader
        reloads = CounterMetricFamily("pdcluster_router_https_reloads",
                                      "HTTPS certificate / client-CA bundle reloads", labels=["what"])
        reloads.add_metric(["certificate"], r.reloads)
        reloads.add_metric(["client_ca"], r.ca_reloads)
        yield reloads
        yield CounterMetricFamily("pdcluster_router_https_resumed_refused",
                                  "Resumed TLS sessions closed: no CA of the current bundle issued the client "
                                  "certificate", value=r.resumed_refused)
