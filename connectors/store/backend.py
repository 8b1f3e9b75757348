"""The store connector's port to an object store: a small ABC every backend implements.

The backends (kvstore_backend.py, mooncake_backend.py) import this port; backend_factory.py
finds them by name and builds them, so the port knows no backend.

Both hold the same objects under the same keys (StoreLayout), so a deployment that outgrows the
built-in store moves to Mooncake by changing `backend` and its address, nothing else.

Buffers are contiguous CPU tensors (or anything `pdcluster.transfer.as_byte_view` accepts for
the built-in store). Backends that move bytes by address (Mooncake) need the memory registered
first: the connector registers its staging arenas once with `register_buffer`.
Every call may raise StoreBackendError (store unreachable); per-key outcomes are in the results.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class StoreBackendError(Exception):
    """The store could not be reached or answered garbage; the whole call failed."""


class PutResult(enum.IntEnum):
    STORED = 0  # this call wrote the object
    EXISTS = 1  # already there, or another writer is finishing it: nothing to do
    FAILED = 2  # not stored (no space, transfer error): the caller may retry later


class StoreBackend(ABC):
    name = "abstract"

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> StoreBackend:
        """Build the backend from the connector's backend options (see options.py); every
        backend that backend_factory.py builds by name implements this."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from options")

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """One flag per key: the object is complete and readable."""

    @abstractmethod
    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[PutResult]:
        """Store each buffer's bytes under its key (objects are immutable: an existing key stays)."""

    @abstractmethod
    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Read each object into its buffer; True only when the whole object (of exactly the
        buffer's size) landed. A miss or a failed read is False, never partial data reported good."""

    @abstractmethod
    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Remove objects; True per key that was removed."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; idempotent."""

    def register_buffer(self, buffer: Any) -> None:  # noqa: B027 - optional hook, no-op by default
        """Make `buffer` (a contiguous CPU tensor) usable for zero-copy puts and gets."""

    def unregister_buffer(self, buffer: Any) -> None:  # noqa: B027 - optional hook
        """Undo register_buffer before the memory goes away."""


__all__ = ["PutResult", "StoreBackend", "StoreBackendError"]
