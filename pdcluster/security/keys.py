"""CURVE key pairs for the cluster's nodes and clients: make them, store them, load them.

Directory layout made by `init_keys(DIR)` (`pdcluster keys init DIR`):

    DIR/                      mode 0700
      public/NAME.key         the allow-list: one public key per node or client (shareable)
      secret/NAME.key_secret  mode 0600, inside a 0700 folder; holds the public and secret key

Files use ZeroMQ's certificate format (ZPL, the same as `zmq.auth.create_certificates`), so
`zmq.auth.load_certificate` and czmq tools read them too. Secret files are created with mode 0600
by `os.open(..., O_CREAT | O_EXCL, 0o600)`: there is no window in which they are readable by
others, which a write-then-chmod would leave open.

Launchers that hand keys to processes (Ray actors) pass them as strings (`keypair_to_string`),
preferably through the environment (`keypair_from_env`): /proc/PID/environ is readable by the
owner only, while /proc/PID/cmdline is world-readable.
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

DEFAULT_KEY_NAMES: tuple[str, ...] = ("router", "worker", "kvstore", "client")
PUBLIC_DIR = "public"
SECRET_DIR = "secret"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
Z85_KEY_LEN = 40  # a 32-byte Curve25519 key in Z85
RAW_KEY_LEN = 32
# Key names become file names: no separators, no leading dot, bounded length.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# ',' is not in the Z85 alphabet, so it separates public and secret in the string form.
_STRING_SEP = ","
_MAX_KEY_FILE_SIZE = 4096


class KeyMaterialError(ValueError):
    """Invalid, missing or unsafe key material (the message says which file and why)."""


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair in Z85 (40 ASCII bytes each). `secret` is None for a peer's public key."""

    name: str
    public: bytes
    secret: bytes | None = field(default=None, repr=False)  # never printed in logs

    def __post_init__(self) -> None:
        object.__setattr__(self, "public", normalize_public_key(self.public))
        if self.secret is not None:
            secret = _as_z85(self.secret, "secret key")
            if zmq.curve_public(secret) != self.public:
                raise KeyMaterialError(f"key pair {self.name!r}: the secret key does not match the public key")
            object.__setattr__(self, "secret", secret)

    @property
    def has_secret(self) -> bool:
        return self.secret is not None


@dataclass(frozen=True)
class KeySet:
    """What `init_keys` made: the root folder and the key pairs by name."""

    root: pathlib.Path
    keypairs: Mapping[str, KeyPair]

    @property
    def public_dir(self) -> pathlib.Path:
        return self.root / PUBLIC_DIR

    def allowed_public_keys(self) -> dict[str, bytes]:
        return {name: kp.public for name, kp in self.keypairs.items()}


def normalize_public_key(key: bytes | str) -> bytes:
    """A public key as Z85 bytes; accepts Z85 (str or bytes) or the raw 32 bytes."""
    return _as_z85(key, "public key")


def _as_z85(key: bytes | str, what: str) -> bytes:
    if isinstance(key, str):
        key = key.encode("ascii", errors="strict") if key.isascii() else b""
    if not isinstance(key, bytes):
        raise KeyMaterialError(f"{what} must be bytes or str, got {type(key).__name__}")
    if len(key) == RAW_KEY_LEN:
        return z85.encode(key)
    if len(key) != Z85_KEY_LEN:
        raise KeyMaterialError(f"{what} must be {Z85_KEY_LEN} Z85 characters or {RAW_KEY_LEN} raw bytes")
    try:
        z85.decode(key)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise KeyMaterialError(f"{what} is not valid Z85") from e
    return key


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise KeyMaterialError(f"invalid key name {name!r}: use letters, digits, '_', '.', '-' (max 64)")
    return name


def generate_keypair(name: str) -> KeyPair:
    public, secret = zmq.curve_keypair()
    return KeyPair(_check_name(name), public, secret)


# -- files ------------------------------------------------------------------------------------
def _cert_text(kp: KeyPair, with_secret: bool) -> str:
    kind = "Secret" if with_secret else "Public"
    lines = [
        f"#   ****  ZeroMQ CURVE {kind} Certificate (pdcluster key {kp.name!r})  ****",
        "#   Made by `pdcluster keys init`." + ("  DO NOT PROVIDE THIS FILE TO OTHER USERS." if with_secret else ""),
        "",
        "metadata",
        f'    name = "{kp.name}"',
        "curve",
        f'    public-key = "{kp.public.decode()}"',
    ]
    if with_secret:
        assert kp.secret is not None
        lines.append(f'    secret-key = "{kp.secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write_new(path: pathlib.Path, text: str, mode: int, overwrite: bool) -> None:
    """Create path with `mode` from the start. With overwrite, write a fresh temp file (same
    mode) and rename it over the old one, so a reader never sees a half-written key."""
    target = path
    if overwrite:
        path = path.with_name(f".{path.name}.tmp{os.getpid()}")
        path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        os.write(fd, text.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    if overwrite:
        os.replace(path, target)


def _make_dir(path: pathlib.Path, mode: int) -> None:
    path.mkdir(mode=mode, parents=False, exist_ok=True)
    # mkdir's mode is filtered by the umask and ignored for an existing folder: tighten only
    # (never loosen) a folder that holds secrets.
    current = path.stat().st_mode & 0o777
    if current & ~mode:
        os.chmod(path, current & mode)


def init_keys(
    directory: str | os.PathLike[str],
    names: Iterable[str] = DEFAULT_KEY_NAMES,
    *,
    overwrite: bool = False,
) -> KeySet:
    """Make one CURVE key pair per name under `directory` (see the module docstring for the
    layout). Refuses to replace an existing key unless overwrite=True; checks every name before
    writing anything, so a refusal leaves the folder as it was."""
    root = pathlib.Path(directory)
    names = [_check_name(n) for n in names]
    if not names or len(set(names)) != len(names):
        raise KeyMaterialError(f"key names must be non-empty and unique, got {names}")
    public_dir, secret_dir = root / PUBLIC_DIR, root / SECRET_DIR
    if not overwrite:
        existing = [
            str(p)
            for n in names
            for p in (public_dir / f"{n}{PUBLIC_SUFFIX}", secret_dir / f"{n}{SECRET_SUFFIX}")
            if p.exists()
        ]
        if existing:
            raise FileExistsError(f"refusing to overwrite existing keys {existing}; pass overwrite=True")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    _make_dir(public_dir, 0o755)
    _make_dir(secret_dir, 0o700)
    keypairs: dict[str, KeyPair] = {}
    for n in names:
        kp = generate_keypair(n)
        _write_new(secret_dir / f"{n}{SECRET_SUFFIX}", _cert_text(kp, True), 0o600, overwrite)
        _write_new(public_dir / f"{n}{PUBLIC_SUFFIX}", _cert_text(kp, False), 0o644, overwrite)
        keypairs[n] = kp
    return KeySet(root, keypairs)


def ensure_instance_keys(directory: str | os.PathLike[str], names: Iterable[str]) -> dict[str, KeyPair]:
    """One CURVE pair per instance NAME in a key folder: loaded when it is there already (a
    restart keeps its identity), else made (0600, exclusive create) beside the cluster's keys,
    so every server that reads the folder allows it. Per-instance pairs let servers tell the
    processes apart (P2P lease owners, refusal logs); one shared "worker" pair cannot."""
    out: dict[str, KeyPair] = {}
    for name in names:
        try:
            out[name] = load_keypair(directory, name)
        except KeyMaterialError:
            if (pathlib.Path(directory) / PUBLIC_DIR / f"{_check_name(name)}{PUBLIC_SUFFIX}").exists():
                raise  # a public key without its secret: not ours to replace
            out[name] = init_keys(directory, [name]).keypairs[name]
    return out


ROTATION_SUFFIX = ".next"  # the new pair during a rotation; curve.py gives it NAME's User-Id


def rotate_key(directory: str | os.PathLike[str], name: str) -> KeyPair:
    """Step 1 of a rotation: write NAME.next beside NAME (both are then on the allow-list of
    every server that re-reads the folder). Clients switch to NAME.next's secret; then
    revoke_old_key. Refuses when a rotation of NAME is already under way."""
    root = pathlib.Path(directory)
    _check_name(name)
    if not (root / PUBLIC_DIR / f"{name}{PUBLIC_SUFFIX}").is_file():
        raise KeyMaterialError(f"no key {name!r} in {root} to rotate")
    kp = generate_keypair(name + ROTATION_SUFFIX)
    _write_new(root / SECRET_DIR / f"{kp.name}{SECRET_SUFFIX}", _cert_text(kp, True), 0o600, False)
    _write_new(root / PUBLIC_DIR / f"{kp.name}{PUBLIC_SUFFIX}", _cert_text(kp, False), 0o644, False)
    return kp


def revoke_old_key(directory: str | os.PathLike[str], name: str) -> None:
    """Step 2: NAME.next becomes NAME; the old key is gone. One rename of the public file takes
    the allow-list from {old, new} to {new} atomically (the secret is renamed first)."""
    root = pathlib.Path(directory)
    nxt = _check_name(name) + ROTATION_SUFFIX
    pub, sec = root / PUBLIC_DIR, root / SECRET_DIR
    if not (pub / f"{nxt}{PUBLIC_SUFFIX}").is_file():
        raise KeyMaterialError(f"no rotation of {name!r} under way in {root} (run rotate first)")
    if (sec / f"{nxt}{SECRET_SUFFIX}").exists():
        os.replace(sec / f"{nxt}{SECRET_SUFFIX}", sec / f"{name}{SECRET_SUFFIX}")
    os.replace(pub / f"{nxt}{PUBLIC_SUFFIX}", pub / f"{name}{PUBLIC_SUFFIX}")


def _parse_cert(path: pathlib.Path) -> tuple[bytes | None, bytes | None]:
    """(public, secret) from a ZPL certificate; strict: only the two curve keys are read."""
    if path.stat().st_size > _MAX_KEY_FILE_SIZE:
        raise KeyMaterialError(f"{path}: too large for a key file")
    public = secret = None
    for line in path.read_text(encoding="ascii").splitlines():
        m = re.match(r'^\s*(public-key|secret-key)\s*=\s*"([^"]*)"\s*$', line)
        if m and m.group(1) == "public-key":
            public = m.group(2).encode()
        elif m:
            secret = m.group(2).encode()
    return public, secret


def load_keypair(
    directory: str | os.PathLike[str], name: str, *, check_permissions: bool = True
) -> KeyPair:
    """Load NAME's key pair (with its secret) from DIR/secret/NAME.key_secret.

    Like ssh, refuses a secret file that group or others can read (check_permissions=False
    turns that off, e.g. for a read-only secret volume whose modes cannot be set)."""
    path = pathlib.Path(directory) / SECRET_DIR / f"{_check_name(name)}{SECRET_SUFFIX}"
    if not path.is_file():
        raise KeyMaterialError(f"no secret key file {path}")
    mode = path.stat().st_mode & 0o777
    if check_permissions and mode & 0o077:
        raise KeyMaterialError(f"{path} has mode {mode:o}; secret keys must not be readable by others (0600)")
    public, secret = _parse_cert(path)
    if public is None or secret is None:
        raise KeyMaterialError(f"{path}: missing public-key or secret-key")
    return KeyPair(name, public, secret)


def load_public_key(path: str | os.PathLike[str]) -> KeyPair:
    p = pathlib.Path(path)
    public, _ = _parse_cert(p)
    if public is None:
        raise KeyMaterialError(f"{p}: missing public-key")
    return KeyPair(_check_name(p.name.removesuffix(PUBLIC_SUFFIX)), public)


def load_allowed_public_keys(directory: str | os.PathLike[str]) -> dict[str, bytes]:
    """The allow-list {name: Z85 public key} from every NAME.key file in a public-key folder.

    `directory` is either a key root made by init_keys (its `public/` is read) or the
    public-key folder itself. A malformed file is an error, not skipped: a silently shorter
    allow-list is a confusing outage, a silently longer one is a hole."""
    d = pathlib.Path(directory)
    if (d / PUBLIC_DIR).is_dir():
        d = d / PUBLIC_DIR
    if not d.is_dir():
        raise KeyMaterialError(f"no public-key folder {d}")
    out: dict[str, bytes] = {}
    for p in sorted(d.glob(f"*{PUBLIC_SUFFIX}")):
        kp = load_public_key(p)
        out[kp.name] = kp.public
    return out


# -- strings (for launchers) ------------------------------------------------------------------
def keypair_to_string(kp: KeyPair) -> str:
    """'PUBLIC,SECRET' in Z85 (or just 'PUBLIC'). Treat the result as a secret."""
    if kp.secret is None:
        return kp.public.decode()
    return f"{kp.public.decode()}{_STRING_SEP}{kp.secret.decode()}"


def keypair_from_string(text: str, name: str = "peer") -> KeyPair:
    """Inverse of keypair_to_string; checks the secret matches the public key."""
    public, sep, secret = text.strip().partition(_STRING_SEP)
    return KeyPair(_check_name(name), public.encode(), secret.encode() if sep else None)


def keypair_from_env(var: str, name: str = "peer") -> KeyPair:
    text = os.environ.get(var)
    if not text:
        raise KeyMaterialError(f"environment variable {var} is not set")
    return keypair_from_string(text, name)
