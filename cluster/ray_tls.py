"""Mutual TLS for `pdcluster up` (issue 16, item 1): the launcher holds the cluster CA and gives
each actor only its own certificate, as PEM in the actor's start-up environment (the same path
as its CURVE keys: Ray's actor creation arguments, never request data, a command line or a
shared file). The actor writes its PEM into a private folder on its node (0700, key 0600) and
hands serve-worker (or the in-process router) the paths, as `serve` does (internal_tls.py).

    launcher:  CA = DIR/tls of --key-dir (`pdcluster keys init`), else one made in memory for
               this cluster (its key is never written anywhere)
               worker NAME -> env {cert, key, CA bundle} of spiffe://pdcluster/worker/NAME
               router      -> env {cert, key, CA bundle} of spiffe://pdcluster/router/router
    worker:    serve-worker --tls-cert --tls-key --tls-ca (mTLS required, role authz, reloads)
    router:    channels to the workers present the router certificate, verify the CA and the
               name WORKER_SERVER_NAME (in every worker certificate: a restarted actor may land
               on another node, so its address is not known when the certificate is made)

The folders go with their actor, even a SIGKILLed one (private_dirs.py). A CA rotation on
--key-dir reaches the running actors without a restart: ray_tls_push.py (launcher side) and
ray_tls_update.py (actor side). `--insecure-internal` keeps the old plaintext planes. The store connector reaches a kvstore
master with the worker's own identity when its options say `"tls_identity": "worker"` (the
master must then trust this CA: give `up` the --key-dir whose CA issued the master's certs).
"""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

from pdcluster.cluster.private_dirs import PrivateFolder, make_private_folder

ENV_CERT = "PDCLUSTER_TLS_CERT_PEM"
ENV_KEY = "PDCLUSTER_TLS_KEY_PEM"
ENV_CA = "PDCLUSTER_TLS_CA_PEM"
TLS_ENV = (ENV_CERT, ENV_KEY, ENV_CA)
WORKER_SERVER_NAME = "pdcluster-worker"


@dataclass(frozen=True)
class TLSPaths:
    folder: str
    cert: str
    key: str
    ca: str
    # The folder's lock and reaper (private_dirs.py): it goes with its actor, even a SIGKILLed one.
    owner: PrivateFolder | None = None

    def server_argv(self) -> list[str]:
        return ["--tls-cert", self.cert, "--tls-key", self.key, "--tls-ca", self.ca]

    def remove(self) -> None:
        if self.owner is not None:
            self.owner.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class LauncherTLS:
    """The launcher's CA and the per-actor environments it issues."""

    def __init__(self, key_dir: str | None) -> None:
        from pdcluster.security.pki import CA_KEY, TLS_DIR, ClusterCA

        self.key_dir: str | None = None  # the folder the CA is re-read from on reload()
        if key_dir and (pathlib.Path(key_dir) / TLS_DIR / CA_KEY).is_file():
            self.ca = ClusterCA(key_dir)
            self.key_dir = key_dir
            self.source = f"{key_dir}/{TLS_DIR}"
        else:
            self.ca = ClusterCA.ephemeral("pdcluster up CA")
            self.source = "a CA made for this cluster (in memory)"
        self._bundle = self.ca.ca_pem().decode()

    @property
    def bundle(self) -> str:
        return self._bundle

    @property
    def issuer(self) -> str:
        """The issuing CA's subject, as an issued certificate's issuer reads (RFC 4514)."""
        return self.ca._cert.subject.rfc4514_string()

    def reload(self) -> bool:
        """Re-read the CA from --key-dir (after `keys rotate-ca` / `keys revoke-ca`); True if the
        issuing CA or the bundle changed. ValueError while a rotation is half written (the new
        CA key beside the old certificate): nothing is changed, try again."""
        from cryptography.hazmat.primitives import serialization

        from pdcluster.security.pki import ClusterCA

        if self.key_dir is None:
            return False
        ca = ClusterCA(self.key_dir)
        fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        if ca._cert.public_key().public_bytes(*fmt) != ca._key.public_key().public_bytes(*fmt):
            raise ValueError(f"{self.source}: ca.key does not match the first CA of ca.pem (rotation in progress?)")
        bundle = ca.ca_pem().decode()
        changed = bundle != self._bundle or ca._cert != self.ca._cert
        self.ca, self._bundle = ca, bundle
        return changed

    def identity_env(self, role: str, name: str) -> dict[str, str]:
        """A fresh identity for the actor ROLE/NAME (worker or router), as worker_env/router_env give."""
        return self.worker_env(name) if role == "worker" else self.env(role, name)

    def env(self, role: str, name: str, hosts: tuple[str, ...] = ()) -> dict[str, str]:
        key, cert = self.ca.issue_pem(role, name, hosts)
        return {ENV_CERT: cert.decode(), ENV_KEY: key.decode(), ENV_CA: self._bundle}

    def worker_env(self, name: str) -> dict[str, str]:
        return self.env("worker", name, (WORKER_SERVER_NAME,))

    def router_env(self) -> dict[str, str]:
        return self.env("router", "router")


def split_env(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str] | None]:
    """(env without the TLS PEMs, the PEMs or None): a child process never sees key material
    in its environment, only the paths of its own files."""
    rest = {k: v for k, v in env.items() if k not in TLS_ENV}
    if not all(k in env for k in TLS_ENV):
        return rest, None
    return rest, {k: env[k] for k in TLS_ENV}


def write_identity(pems: Mapping[str, str], parent: str | None = None) -> TLSPaths:
    """The PEMs as files in a new private folder (0700; key 0600, created exclusively). Without
    `parent` the folder is tied to this process (private_dirs.py: removed when it dies, however);
    inside `parent` (another private folder) it goes with that one."""
    owner = make_private_folder("pdcluster-tls-", parent)
    folder = owner.path
    paths = TLSPaths(folder, f"{folder}/cert.pem", f"{folder}/key.pem", f"{folder}/ca.pem", owner)
    try:
        for path, var, mode in ((paths.key, ENV_KEY, 0o600), (paths.cert, ENV_CERT, 0o644),
                                (paths.ca, ENV_CA, 0o644)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
            try:
                os.write(fd, pems[var].encode())
            finally:
                os.close(fd)
    except BaseException:
        paths.remove()
        raise
    return paths


def router_worker_tls(paths: TLSPaths) -> object:
    """The router's TLSConfig for its worker channels."""
    from pdcluster.worker.tls import TLSConfig

    return TLSConfig(ca=paths.ca, cert=paths.cert, key=paths.key, server_name=WORKER_SERVER_NAME)
