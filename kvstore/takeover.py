"""When a standby may take over from a primary it cannot reach (kvstore/standby.py).

Two masters and no third voter cannot tell "the primary died" from "the primary is alive and
cut off from me": both look like silence. A standby that promotes on silence alone can give two
primaries during a partition (the old one keeps accepting writes, which are discarded when it
later follows the new one). So by default (`on-refusal`) the standby promotes only on evidence
that no primary process is left: a TCP connect to the primary's address refused (its host
answers, nothing listens: the process is gone, as after a crash or SIGKILL). Silence (a
timeout, an unreachable network, a stopped process whose kernel still accepts connections, a
connection accepted and then reset or blackholed) is not evidence: the standby keeps refusing
writes (NOT_PRIMARY), counts `takeovers_refused` and logs a WARNING naming the primary, until
the primary comes back (it follows it again) or an operator says it is dead:

    kill -USR1 <standby pid>          promote now (the operator fenced the old primary)
    --takeover on-silence             promote on silence too (the old behaviour: use only where
                                      a partition cannot happen, or the old primary is fenced
                                      by other means, e.g. STONITH)

Known gap: a firewall that REJECTs (answers RST) looks like a dead primary.
"""

from __future__ import annotations

import socket

TAKEOVER_MODES = ("on-refusal", "on-silence")


def connection_refused(addr: str, timeout_s: float) -> bool:
    """True only if the host at `addr` ("host:port", "[v6]:port") answered the connect with a refusal."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return False  # something accepts connections there (maybe stopped, maybe a middlebox)
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False  # timed out, no route, bad address: silence, not evidence


def takeover_reason(mode: str, addr: str, lost_s: float, timeout_s: float, operator: bool) -> str | None:
    """Why the standby may promote now, or None (keep refusing writes)."""
    if operator:
        return "the operator asked (SIGUSR1)"
    if mode == "on-silence":
        return f"unreachable for {lost_s:.1f}s (--takeover on-silence)"
    if connection_refused(addr, timeout_s):
        return "its port refuses connections (no master process left)"
    return None
