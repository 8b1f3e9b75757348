"""The data-plane secret shared by the kvstore master (token issuer) and its storage nodes.

The master derives one key per node (`derive_key(secret, "kvstore-node/<id>")`) to sign that
node's tokens; the node derives the same key to verify them. The secret reaches processes
through a 0600 file or the environment (/proc/PID/environ is owner-only; argv is not).
"""

from __future__ import annotations

import binascii
import os
import secrets

from pdcluster.transfer import derive_key

ENV_VAR = "PDCLUSTER_KVSTORE_SECRET"  # hex
SECRET_LEN = 32
_MAX_FILE = 4096


def node_key(secret: bytes, node_id: str) -> bytes:
    return derive_key(secret, f"kvstore-node/{node_id}")


def _parse(text: bytes, where: str) -> bytes:
    try:
        raw = binascii.unhexlify(text.strip())
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: secret must be hex") from e
    if len(raw) < 16:
        raise ValueError(f"{where}: secret must be at least 16 bytes")
    return raw


def load_secret(path: str | None, *, create: bool) -> bytes:
    """From `path` (created with mode 0600 if missing and `create`), else from $PDCLUSTER_KVSTORE_SECRET."""
    if path:
        if not os.path.exists(path):
            if not create:
                raise FileNotFoundError(f"secret file {path} does not exist")
            raw = secrets.token_bytes(SECRET_LEN)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never world-readable
            with os.fdopen(fd, "wb") as f:
                f.write(binascii.hexlify(raw) + b"\n")
            return raw
        if os.stat(path).st_mode & 0o077:
            raise PermissionError(f"secret file {path} must not be readable by group/others (chmod 600)")
        with open(path, "rb") as f:
            return _parse(f.read(_MAX_FILE), path)
    env = os.environ.get(ENV_VAR)
    if env:
        return _parse(env.encode(), ENV_VAR)
    raise ValueError(f"no data-plane secret: pass --secret-file or set {ENV_VAR}")
