"""Rotation without downtime (issue 16 item 7): CURVE allow-lists and gRPC server certificates
are re-read while the process runs; new keys are accepted beside the old, then the old revoked.

CURVE (ZMQ planes):
    keys rotate DIR NAME   -> DIR/public/NAME.next.key (+ secret) beside NAME.key: both allowed
    (restart/re-point clients at NAME.next)
    keys revoke DIR NAME   -> NAME.next replaces NAME: the old key leaves every allow-list
    KeyDirWatcher(auth, {sock: DIR}).start() re-reads the public folders when they change (a
    stat poll every few seconds, or reload() at once, e.g. from a SIGHUP handler). Why a poll and
    not only SIGHUP: it needs no signal plumbing in every launcher (Ray actors, children of
    `serve`) and a stat of one folder every 2 s costs nothing; SIGHUP can still call reload().
    Live sessions: libzmq cannot close one authenticated peer of a ROUTER/PULL socket, so the
    ZAP handler tags each session with its key (metadata X-Curve-Key) and a server drops every
    further message whose key is no longer allowed (CurveAuthenticator.session_allowed). The
    TCP connection stays open until the peer goes, but nothing it sends is served.

TLS (gRPC servers): dynamic_server_credentials() gives grpc a certificate_configuration_fetcher
that gRPC core calls at each new handshake; it re-reads cert/key/CA bundle when their files
changed (stat: inode, mtime, size) and only when the key matches the certificate, so a half
written pair keeps the previous configuration. CA rotation (pki.py): begin_ca_rotation makes a
new CA, the bundle holds new+old; reissue() gives each instance a new-CA certificate; then
finish_ca_rotation drops the old CA, after which handshakes with old certificates fail.
Live HTTP/2 connections are not re-verified (TLS checks only at the handshake): a connection
made before the revocation keeps working until it closes; servers that must bound this set
grpc.max_connection_age_ms (the client then reconnects and must present a current cert).
Channels (clients) read their files once: a router picks up a new certificate when it opens a
new channel (load_client_credentials reads a matching key/cert pair).
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
from collections.abc import Callable, Collection, Mapping

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from .keys import ROTATION_SUFFIX, KeyMaterialError, load_allowed_public_keys

log = logging.getLogger(__name__)

DEFAULT_POLL_S = 2.0
_MAX_PEM_BYTES = 1 << 20


def _stamp(path: str | os.PathLike[str]) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns, st.st_size


def _dir_stamp(directory: pathlib.Path) -> tuple[tuple[str, int, int, int], ...]:
    d = directory / "public" if (directory / "public").is_dir() else directory
    return tuple(sorted((p.name, *_stamp(p)) for p in d.iterdir()))


# -- CURVE ------------------------------------------------------------------------------------
class KeyDirWatcher:
    """Keeps the allow-list of CURVE server sockets equal to their public-key folders."""

    def __init__(self, auth: object, sockets: Mapping[object, str | os.PathLike[str]],
                 poll_s: float = DEFAULT_POLL_S, only: Collection[str] | None = None,
                 on_revoked: Callable[[object, Mapping[str, bytes], list[str]], None] | None = None) -> None:
        """only: admit just the keys of these names (and their NAME.next), e.g. the routers
        of a KV-event publisher; None: every key in the folder.
        on_revoked(sock, allowed, gone): called (on the watcher's thread, so it must only hand
        the work over) after keys left a socket's allow-list, for sockets whose live sessions
        cannot be refused message by message (a PUB socket receives nothing to drop: its owner
        closes it and binds a new one, see replace_socket)."""
        self._auth = auth  # a CurveAuthenticator (typed loosely: curve.py imports nothing of us)
        self._sockets = {s: pathlib.Path(d) for s, d in sockets.items()}
        self._on_revoked = on_revoked
        self._poll_s = poll_s
        self._only = None if only is None else frozenset(only)
        self._stamps: dict[object, object] = {}  # per socket: two sockets may share one folder
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.applied = 0  # allow-lists applied so far (by reload or the poll)

    def reload(self, force: bool = True) -> dict[str, list[str]]:
        """Re-read the folders (all when force, else the changed ones); apply each allow-list.
        Returns {socket domain: names revoked}. A folder that fails to parse keeps its old list."""
        revoked: dict[str, list[str]] = {}
        with self._lock:
            for sock, directory in self._sockets.items():
                try:
                    stamp = _dir_stamp(directory)
                    if not force and self._stamps.get(sock) == stamp:
                        continue
                    allowed = load_allowed_public_keys(directory)
                    if self._only is not None:
                        allowed = {n: k for n, k in allowed.items()
                                   if n.removesuffix(ROTATION_SUFFIX) in self._only}
                except (OSError, KeyMaterialError) as e:
                    log.error("key reload of %s failed, keeping the current allow-list: %s", directory, e)
                    continue
                try:
                    gone = self._auth.set_allowed(sock, allowed)  # type: ignore[attr-defined]
                except KeyError:  # closed by its owner, who is swapping it (replace_socket)
                    continue
                self._stamps[sock] = stamp
                self.applied += 1
                if gone:
                    log.warning("CURVE keys revoked on %s: %s", sock.zap_domain.decode(), ", ".join(gone))
                    if self._on_revoked is not None:
                        self._on_revoked(sock, allowed, gone)
                revoked[sock.zap_domain.decode()] = gone  # type: ignore[attr-defined]
        return revoked

    def replace_socket(self, old: object, new: object) -> None:
        """Watch `new` (bound by its owner with a current allow-list) instead of `old` (closed).
        Its folder is re-read at the next poll, so a change that raced the swap is applied."""
        with self._lock:
            self._sockets[new] = self._sockets.pop(old)
            self._stamps.pop(old, None)

    def start(self) -> KeyDirWatcher:
        self.reload(force=True)
        self._thread = threading.Thread(target=self._run, name="pdcluster-key-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.reload(force=False)
            except Exception:  # a bad poll must not end rotation for the process's lifetime
                log.exception("key directory poll failed")


def reload_on_sighup(watcher: KeyDirWatcher) -> Callable[[], None]:
    """Make SIGHUP call watcher.reload() at once (main thread only; the previous handler is
    chained). Returns a function that puts the previous handler back."""
    import signal

    previous = signal.getsignal(signal.SIGHUP)

    def handler(signum: int, frame: object) -> None:
        # Signal handlers run between bytecodes of the main thread: hand the work to a thread
        # so a reload never runs while that thread holds the watcher's lock.
        threading.Thread(target=watcher.reload, name="pdcluster-key-reload", daemon=True).start()
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGHUP, handler)
    return lambda: signal.signal(signal.SIGHUP, previous)


# -- TLS --------------------------------------------------------------------------------------
def _read_pem(path: str) -> bytes:
    p = pathlib.Path(path)
    if p.stat().st_size > _MAX_PEM_BYTES:
        raise ValueError(f"{path} is too large for a PEM file")
    data = p.read_bytes()
    if b"-----BEGIN" not in data:
        raise ValueError(f"{path} is not PEM")
    return data


def matching_pair(cert_path: str, key_path: str) -> tuple[bytes, bytes]:
    """(key PEM, cert PEM) read from disk; ValueError unless the key belongs to the certificate
    (a rotation in progress may have replaced one file and not yet the other)."""
    key_pem, cert_pem = _read_pem(key_path), _read_pem(cert_path)
    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, None)
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(*fmt) != key.public_key().public_bytes(*fmt):
        raise ValueError(f"{key_path} does not match {cert_path}")
    return key_pem, cert_pem


class _CertFetcher:
    """certificate_configuration_fetcher: None = keep the current configuration."""

    def __init__(self, cert: str, key: str, ca: str | None,
                 on_handshake: Callable[[], None] | None = None) -> None:
        self.paths = [p for p in (cert, key, ca) if p is not None]
        self.cert, self.key, self.ca = cert, key, ca
        self.stamps = self._stamps()
        self.reloads = 0
        self.on_handshake = on_handshake  # gRPC core calls us once per new connection (tls_audit.py)

    def _stamps(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(_stamp(p) for p in self.paths)

    def config(self) -> grpc.ServerCertificateConfiguration:
        key, cert = matching_pair(self.cert, self.key)
        ca = _read_pem(self.ca) if self.ca is not None else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        if self.on_handshake is not None:
            try:
                self.on_handshake()
            except Exception:  # counting must never cost a handshake
                log.exception("TLS handshake audit failed")
        try:
            stamps = self._stamps()
            if stamps == self.stamps:
                return None
            cfg = self.config()
        except (OSError, ValueError) as e:  # mid-rotation or broken files: keep what works
            log.warning("TLS reload skipped, keeping the current certificate: %s", e)
            return None
        self.stamps = stamps
        self.reloads += 1
        log.info("TLS server certificate/CA bundle reloaded from %s", self.cert)
        return cfg


def dynamic_server_credentials(cert: str, key: str, ca: str | None, *,
                               on_handshake: Callable[[], None] | None = None) -> tuple[grpc.ServerCredentials,
                                                                                         Callable]:
    """Server credentials that follow the files: (credentials, fetcher). With `ca` the server
    requires client certificates signed by a CA in that bundle (mutual TLS). on_handshake is
    called before each new connection's handshake (tls_audit.HandshakeAudit.on_handshake)."""
    fetcher = _CertFetcher(cert, key, ca, on_handshake)
    creds = grpc.dynamic_ssl_server_credentials(fetcher.config(), fetcher,
                                                require_client_authentication=ca is not None)
    return creds, fetcher


def load_client_credentials(ca: str, cert: str | None = None, key: str | None = None,
                            attempts: int = 5) -> grpc.ChannelCredentials:
    """Channel credentials from the current files; retries a torn key/cert pair (a reissue
    between the two reads) a few times before giving up with ValueError."""
    if cert is None or key is None:
        return grpc.ssl_channel_credentials(root_certificates=_read_pem(ca))
    for i in range(attempts):
        try:
            key_pem, cert_pem = matching_pair(cert, key)
            return grpc.ssl_channel_credentials(root_certificates=_read_pem(ca), private_key=key_pem,
                                                certificate_chain=cert_pem)
        except ValueError:
            if i == attempts - 1:
                raise
    raise AssertionError("unreachable")
