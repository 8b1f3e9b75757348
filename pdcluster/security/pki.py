"""The cluster's X.509 identities for its internal gRPC planes (mutual TLS): a private CA and
one certificate per process instance, whose identity carries its role.

Layout made by `init_pki(DIR)` (`pdcluster keys init DIR` makes it beside the CURVE keys):

    DIR/tls/                    mode 0700
      ca.pem                    the cluster CA certificate (the trust anchor every process gets)
      ca.key                    mode 0600: the CA's key; only the launcher that issues needs it
      NAME/                     mode 0700, one per instance: hand a process only its own folder
        cert.pem                its certificate, signed by the CA
        key.pem                 mode 0600

Identity: each certificate has CN=NAME and a SAN URI spiffe://pdcluster/ROLE/NAME (ROLE one of
ROLES), plus SANs localhost / 127.0.0.1 / the given hosts so it also serves TLS. Servers verify
clients against ca.pem only (a certificate from another CA fails the handshake), and then read
the role from the SAN (identity.py) to authorize by role.

Keys are ECDSA P-256 (fast handshakes, small certs), made with `cryptography`; secret files are
created 0600 with O_EXCL, never written then chmod-ed.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .keys import KeyMaterialError, _check_name

ROLES = ("router", "worker", "kvstore-master", "kvstore-node", "client")
SPIFFE_PREFIX = "spiffe://pdcluster/"
TLS_DIR = "tls"
CA_CERT, CA_KEY = "ca.pem", "ca.key"
CERT, KEY = "cert.pem", "key.pem"
VALID_DAYS = 365


@dataclass(frozen=True)
class Identity:
    """One process's TLS identity: paths to hand it (argv/env of the child), never its peers'."""

    role: str
    name: str
    cert: str
    key: str
    ca: str

    @property
    def uri(self) -> str:
        return spiffe_uri(self.role, self.name)


def spiffe_uri(role: str, name: str) -> str:
    return f"{SPIFFE_PREFIX}{role}/{name}"


def _write_secret(path: pathlib.Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _write_public(path: pathlib.Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _private_dir(path: pathlib.Path) -> pathlib.Path:
    path.mkdir(mode=0o700, parents=False, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class ClusterCA:
    """The CA of one folder (made by init_pki, or loaded); issues instance certificates."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.dir = pathlib.Path(root) / TLS_DIR
        try:
            # ca.pem is a bundle during a CA rotation: the first certificate is the issuing CA.
            self._cert = x509.load_pem_x509_certificates((self.dir / CA_CERT).read_bytes())[0]
            self._key = serialization.load_pem_private_key((self.dir / CA_KEY).read_bytes(), None)
        except (OSError, ValueError) as e:
            raise KeyMaterialError(f"no usable cluster CA in {self.dir}: {e}") from e

    @classmethod
    def ephemeral(cls, common_name: str = "pdcluster cluster CA") -> ClusterCA:
        """A CA that lives only in this process's memory (its key is never written): for a
        launcher that hands every instance its certificate as PEM (`pdcluster up` on Ray)."""
        ca = cls.__new__(cls)
        ca.dir = None  # type: ignore[assignment]
        ca._key, ca._cert = _make_ca(common_name)
        return ca

    @property
    def ca_path(self) -> str:
        return str(self.dir / CA_CERT)

    def ca_pem(self) -> bytes:
        """The trust bundle peers get (during a CA rotation: new + old)."""
        if self.dir is None:
            return self._cert.public_bytes(serialization.Encoding.PEM)
        return (self.dir / CA_CERT).read_bytes()

    def issue_pem(self, role: str, name: str, hosts: Sequence[str] = ()) -> tuple[bytes, bytes]:
        """(key PEM, certificate PEM) for an instance of ROLE, in memory only: the caller hands
        them to that one instance (e.g. through a Ray actor's start-up environment)."""
        if role not in ROLES:
            raise KeyMaterialError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        _check_name(name)
        key, cert = self._make_cert(role, name, hosts)
        return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, role: str, name: str, hosts: Sequence[str] = ()) -> Identity:
        """Make NAME/{cert,key}.pem for an instance of ROLE (a new name: never overwrites)."""
        if role not in ROLES:
            raise KeyMaterialError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        _check_name(name)
        folder = self.dir / name
        folder.mkdir(mode=0o700)  # FileExistsError for a name issued already
        key, cert = self._make_cert(role, name, hosts)
        _write_secret(folder / KEY, _key_pem(key))
        _write_public(folder / CERT, cert.public_bytes(serialization.Encoding.PEM))
        return Identity(role, name, str(folder / CERT), str(folder / KEY), self.ca_path)

    def reissue(self, name: str, hosts: Sequence[str] = ()) -> Identity:
        """Replace NAME's certificate and key (same role) with ones signed by the current CA.
        Each file is renamed into place (never half written); key first, cert second: a reader
        seeing a new key with the old cert finds them mismatched and retries (rotation.py)."""
        old = load_identity(self.dir.parent, name)
        if not hosts:  # keep the extra names/addresses the instance was issued for
            hosts = _extra_hosts(x509.load_pem_x509_certificate(pathlib.Path(old.cert).read_bytes()))
        key, cert = self._make_cert(old.role, name, hosts)
        folder = self.dir / name
        for target, data, writer in ((folder / KEY, _key_pem(key), _write_secret),
                                     (folder / CERT, cert.public_bytes(serialization.Encoding.PEM), _write_public)):
            tmp = folder / f".{target.name}.new"
            tmp.unlink(missing_ok=True)
            writer(tmp, data)
            os.replace(tmp, target)
        return Identity(old.role, name, old.cert, old.key, self.ca_path)

    def _make_cert(self, role: str, name: str, hosts: Sequence[str]) -> tuple[ec.EllipticCurvePrivateKey,
                                                                              x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_uri(role, name)),
                                        x509.DNSName("localhost")]
        for host in ("127.0.0.1", "::1", *hosts):
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)]))
                .issuer_name(self._cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self._key, hashes.SHA256()))
        return key, cert


def init_pki(root: str | os.PathLike[str], instances: Iterable[tuple[str, str]] = (),
             common_name: str = "pdcluster cluster CA") -> ClusterCA:
    """Make DIR/tls with a fresh CA and a certificate per (role, name) instance."""
    base = pathlib.Path(root)
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder = _private_dir(base / TLS_DIR)
    if (folder / CA_KEY).exists():
        raise KeyMaterialError(f"{folder} already has a CA; remove it to start over")
    key, cert = _make_ca(common_name)
    _write_secret(folder / CA_KEY, _key_pem(key))
    _write_public(folder / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    ca = ClusterCA(base)
    for role, instance in instances:
        ca.issue(role, instance)
    return ca


def _extra_hosts(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = [*san.get_values_for_type(x509.DNSName), *(str(a) for a in san.get_values_for_type(x509.IPAddress))]
    return [n for n in names if n not in ("localhost", "127.0.0.1", "::1")]


def instance_names(root: str | os.PathLike[str]) -> list[str]:
    """The instances that have a certificate in DIR/tls."""
    folder = pathlib.Path(root) / TLS_DIR
    return sorted(p.name for p in folder.iterdir() if (p / CERT).is_file())


def _make_ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _replace(path: pathlib.Path, data: bytes, writer: object) -> None:
    tmp = path.with_name(f".{path.name}.new")
    tmp.unlink(missing_ok=True)
    writer(tmp, data)  # type: ignore[operator]
    os.replace(tmp, path)


def begin_ca_rotation(root: str | os.PathLike[str], common_name: str | None = None) -> ClusterCA:
    """Make a new CA: ca.key becomes the new key (it issues from now on) and ca.pem the bundle
    new + old, so peers trust certificates of both while instances are reissued. The new CA gets
    its own subject name: TLS stacks look up the issuer by name, and with two CAs of one name
    they verify an old certificate against the new key (BAD_SIGNATURE)."""
    folder = pathlib.Path(root) / TLS_DIR
    bundle = (folder / CA_CERT).read_bytes()
    current = x509.load_pem_x509_certificates(bundle)
    if len(current) > 1:
        raise KeyMaterialError(f"{folder / CA_CERT} already holds two CAs: finish that rotation first")
    if common_name is None:
        common_name = f"pdcluster cluster CA {datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S.%f}"
    if common_name == current[0].subject.rfc4514_string().removeprefix("CN="):
        raise KeyMaterialError("the new CA needs a subject name other than the current CA's")
    key, cert = _make_ca(common_name)
    _replace(folder / CA_KEY, _key_pem(key), _write_secret)
    _replace(folder / CA_CERT, cert.public_bytes(serialization.Encoding.PEM) + bundle, _write_public)
    return ClusterCA(root)


def finish_ca_rotation(root: str | os.PathLike[str]) -> None:
    """Revoke the old CA: ca.pem keeps only the issuing (first) CA. Servers that re-read it
    then refuse new handshakes with certificates of the old CA."""
    folder = pathlib.Path(root) / TLS_DIR
    first = x509.load_pem_x509_certificates((folder / CA_CERT).read_bytes())[0]
    _replace(folder / CA_CERT, first.public_bytes(serialization.Encoding.PEM), _write_public)


def load_identity(root: str | os.PathLike[str], name: str) -> Identity:
    folder = pathlib.Path(root) / TLS_DIR
    cert = x509.load_pem_x509_certificate((folder / name / CERT).read_bytes())
    role = identity_of_cert(cert)[0]
    return Identity(role, name, str(folder / name / CERT), str(folder / name / KEY), str(folder / CA_CERT))


def identity_of_cert(cert: x509.Certificate) -> tuple[str, str]:
    """(role, name) from the certificate's spiffe://pdcluster/ROLE/NAME SAN; KeyMaterialError if none."""
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    for uri in uris:
        role_name = parse_spiffe(uri)
        if role_name is not None:
            return role_name
    raise KeyMaterialError("certificate has no spiffe://pdcluster/ROLE/NAME identity")


def parse_spiffe(uri: str) -> tuple[str, str] | None:
    if not uri.startswith(SPIFFE_PREFIX):
        return None
    role, sep, name = uri[len(SPIFFE_PREFIX):].partition("/")
    if not sep or role not in ROLES or not name or "/" in name:
        return None
    return role, name
