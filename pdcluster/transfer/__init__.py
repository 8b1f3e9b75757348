"""pdcluster.transfer: the authenticated bulk data plane (TCP streams + same-host shared memory).

Control planes (kvstore master, P2P producer) mint capability tokens (`issue_token`); the
`TransferServer` that owns the memory verifies them statelessly; a `TransferClient` moves the
bytes zero-copy into/out of caller buffers. Same-host peers map `Region`s in shared memory.
"""

from __future__ import annotations

from .client import TransferClient, TransferError
from .region import Region, ShmSpaceError, alloc_region, as_byte_view, open_shared_region
from .server import TransferServer
from .shm_cache import SharedRegionCache, local_host_id
from .tokens import (
    OP_READ,
    OP_WRITE,
    TOKEN_LEN,
    Capability,
    TokenError,
    derive_key,
    issue_token,
    now_ms,
    parse_token,
    ranges_digest,
    verify_token,
)

__all__ = [
    "OP_READ", "OP_WRITE", "TOKEN_LEN", "Capability", "Region", "SharedRegionCache", "ShmSpaceError", "TokenError",
    "TransferClient", "TransferError", "TransferServer", "alloc_region", "as_byte_view", "derive_key",
    "issue_token", "local_host_id", "now_ms", "open_shared_region", "parse_token", "ranges_digest", "verify_token",
]
