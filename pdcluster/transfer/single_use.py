"""Single use of data-plane tokens: each byte a token covers is served at most once.

Several streams of one transfer present the same token for disjoint windows of its ranges; a
request whose window overlaps one already served under that token is a replay (or a client
bug) and is refused. Entries live until their token's expiry (plus skew): after that the token
check itself refuses it. The table is bounded; when full, new tokens are refused rather than
forgetting live ones (forgetting would reopen the replay window).
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable

from .tokens import Capability, TokenError, now_ms

DEFAULT_MAX_TOKENS = 1 << 16


class SingleUseGuard:
    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, skew_ms: int = 0,
                 clock_ms: Callable[[], int] = now_ms) -> None:
        self._max = max_tokens
        self._skew = skew_ms
        self._clock = clock_ms
        self._lock = threading.Lock()
        self._served: dict[bytes, list[tuple[int, int]]] = {}  # token mac -> served windows
        self._expiry: list[tuple[int, bytes]] = []  # heap of (expiry_ms, token mac)

    def claim(self, token: bytes, cap: Capability, start: int, length: int) -> None:
        """Record the window [start, start+length) of this token; TokenError("replayed") if any
        of it was served before."""
        tag = bytes(token[-32:])  # the token's own MAC: unique per grant
        end = start + length
        with self._lock:
            self._prune()
            windows = self._served.get(tag)
            if windows is None:
                if len(self._served) >= self._max:
                    raise TokenError("single_use_table_full", "too many live tokens to track")
                windows = self._served[tag] = []
                heapq.heappush(self._expiry, (cap.expiry_ms + self._skew, tag))
            for lo, hi in windows:
                if start < hi and lo < end:
                    raise TokenError("replayed", "this part of the token was used already")
            windows.append((start, end))

    def __len__(self) -> int:
        with self._lock:
            return len(self._served)

    def _prune(self) -> None:
        now = self._clock()
        while self._expiry and self._expiry[0][0] < now:
            _, tag = heapq.heappop(self._expiry)
            self._served.pop(tag, None)
