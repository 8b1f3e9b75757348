"""Every listening TCP socket of a set of processes, read from /proc (the tests do not trust a
ready line to name them all): /proc/PID/fd gives the socket inodes, /proc/net/tcp{,6} their
local addresses."""

from __future__ import annotations

import os
import socket

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def socket_inodes(pids: list[int]) -> dict[str, int]:
    """socket inode -> pid, for every socket these processes hold open."""
    out: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out[link[8:-1]] = pid
    return out


def listening(pids: list[int]) -> dict[tuple[str, int], int]:
    """(address, port) -> pid for every listening TCP socket of these processes."""
    inodes = socket_inodes(pids)
    out = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = local.split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = socket.inet_ntop(socket.AF_INET6, raw)
            else:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            out[(addr, int(hexport, 16))] = inodes[inode]
    return out


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def non_loopback(pids: list[int]) -> list[str]:
    """'ADDR:PORT (pid N: cmdline)' for each listener of these processes not on loopback."""
    return [f"{addr}:{port} (pid {pid}: {process_name(pid)})"
            for (addr, port), pid in sorted(listening(pids).items()) if addr not in LOOPBACK]
