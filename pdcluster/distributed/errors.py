"""Errors of a tensor-parallel instance."""

from __future__ import annotations


class TPRankFailedError(RuntimeError):
    """A rank of this tensor-parallel instance died or a collective failed. The ranks' states
    have diverged, so the whole instance is down: every later step raises this too, and the
    engine reports itself unhealthy (EngineCore.is_healthy)."""

    fatal = True
