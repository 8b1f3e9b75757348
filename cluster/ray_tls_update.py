"""Actor side of a TLS rotation under `pdcluster up` (issue 16, item 7): the launcher sends an
actor its reissued certificate and key, or a new CA bundle, as an argument of a Ray call on the
actor's handle (the launcher's channel, never request data), and the actor rewrites the files
in its private TLS folder (ray_tls.write_identity) in place:

    checks    the key matches the certificate, the certificate is this actor's own identity
              (spiffe://pdcluster/ROLE/NAME) and its issuer is in the bundle being written
    writes    ca.pem, then key.pem, then cert.pem, each to a 0600/0644 temporary file in the same
              folder renamed over the old one (a reader sees an old or a new file, never half)

Readers follow the files by themselves: the worker's gRPC server credentials re-read them at
the next handshake (security/rotation.py; a key that does not match its certificate yet is
skipped until it does) and the router rebuilds its worker channels on its next health probe
(router/tls_reload.py).

update fields: ENV_CA (bundle PEM, required), ENV_CERT + ENV_KEY (optional, together), and
MERGE_CA ("1": write the union of the current bundle and ENV_CA, so nothing trusted so far is
dropped while other actors still present their old certificates).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from pdcluster.cluster.ray_tls import ENV_CA, ENV_CERT, ENV_KEY

if TYPE_CHECKING:
    from pdcluster.cluster.ray_tls import TLSPaths

MERGE_CA = "merge_ca"
_MAX_PEM = 1 << 20


class TLSUpdateError(ValueError):
    """The update was refused; the files are unchanged."""


def _certs(pem: str, what: str) -> list[x509.Certificate]:
    if not isinstance(pem, str) or len(pem) > _MAX_PEM:
        raise TLSUpdateError(f"{what}: not a PEM text of at most {_MAX_PEM} bytes")
    try:
        return x509.load_pem_x509_certificates(pem.encode())
    except ValueError as e:
        raise TLSUpdateError(f"{what}: {e}") from e


def _bundle(certs: list[x509.Certificate]) -> bytes:
    seen, out = set(), []
    for c in certs:
        der = c.public_bytes(serialization.Encoding.DER)
        if der not in seen:
            seen.add(der)
            out.append(c.public_bytes(serialization.Encoding.PEM))
    return b"".join(out)


def _check_pair(update: Mapping[str, str], role: str, name: str,
                cas: list[x509.Certificate]) -> x509.Certificate:
    from pdcluster.security.pki import KeyMaterialError, identity_of_cert

    cert = _certs(update[ENV_CERT], "certificate")[0]
    try:
        key = serialization.load_pem_private_key(update[ENV_KEY].encode(), None)
    except (ValueError, TypeError) as e:
        raise TLSUpdateError(f"key: {e}") from e
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(*fmt) != key.public_key().public_bytes(*fmt):
        raise TLSUpdateError("the key does not belong to the certificate")
    try:
        ident = identity_of_cert(cert)
    except KeyMaterialError as e:
        raise TLSUpdateError(str(e)) from e
    if ident != (role, name):
        raise TLSUpdateError(f"the certificate is {ident[0]}/{ident[1]}'s, not this actor's ({role}/{name})")
    if not any(ca.subject == cert.issuer for ca in cas):
        raise TLSUpdateError(f"the certificate's issuer {cert.issuer.rfc4514_string()} is not in the CA bundle")
    return cert


def apply_update(paths: TLSPaths, update: Mapping[str, Any], role: str, name: str) -> dict[str, Any]:
    """Rewrite this actor's TLS files from `update`; TLSUpdateError (nothing changed) if refused.
    Returns what it wrote: the certificate serial now in use and the CAs trusted. An empty
    update changes nothing and returns the serial and issuer in use."""
    if not update:  # a question, not an update: what is in use now
        with open(paths.cert, encoding="ascii") as f:
            cert = _certs(f.read(), "current certificate")[0]
        return {"serial": format(cert.serial_number, "x"), "issuer": cert.issuer.rfc4514_string()}
    if ENV_CA not in update or (ENV_CERT in update) != (ENV_KEY in update):
        raise TLSUpdateError(f"an update carries {ENV_CA}, and {ENV_CERT} with {ENV_KEY} or neither")
    cas = _certs(update[ENV_CA], "CA bundle")
    if update.get(MERGE_CA) == "1":
        with open(paths.ca, encoding="ascii") as f:
            cas = cas + _certs(f.read(), "current CA bundle")
    if ENV_CERT in update:
        cert = _check_pair(update, role, name, cas)
    else:
        with open(paths.cert, encoding="ascii") as f:  # it keeps its certificate: still trusted?
            cert = _certs(f.read(), "current certificate")[0]
        if not any(ca.subject == cert.issuer for ca in cas):
            raise TLSUpdateError("the new CA bundle does not trust this actor's current certificate")
    # CA first: the bundle already trusts the new certificate's issuer when the pair changes.
    _replace(paths.ca, _bundle(cas), 0o644)
    if ENV_CERT in update:  # key before certificate: a reader in between sees a mismatch and waits
        _replace(paths.key, update[ENV_KEY].encode(), 0o600)
        _replace(paths.cert, update[ENV_CERT].encode(), 0o644)
    return {"serial": format(cert.serial_number, "x"), "issuer": cert.issuer.rfc4514_string(),
            "cas": sorted({c.subject.rfc4514_string() for c in cas})}


def _replace(path: str, data: bytes, mode: int) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.new")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
