"""Close gloo's pair listeners to new connections once a TP group is connected.

Why: torch's gloo keeps the descriptor of every connection its listener accepts for the life of
the process, even when the peer hangs up at once or sends bytes that are no pair handshake
(measured: 100 connect-and-close peers = 100 more fds in a rank, never released), and it aborts
the process when accept() fails (EMFILE). So any local process could, by connecting in a loop,
exhaust a rank's descriptors and kill the TP instance. The listener is only needed while the
group connects: gloo connects the full mesh inside the ProcessGroupGloo constructor (unless
TORCH_GLOO_LAZY_INIT is set), and a lost pair is never reconnected (the group fails instead).

How: the listeners this process opened while the groups were built (a diff of /proc's view of
this process's listening sockets around the construction, under a process-wide lock so two TP
instances starting in one process do not see each other's) get a classic BPF socket filter that
drops every packet. On a listening socket that drops new connections' SYNs before accept; the
pair connections already accepted were cloned before the filter and keep working. The listening
socket itself stays open (gloo still owns and closes it), so nothing in gloo notices.

Linux only; anywhere else, or when a filter cannot be attached, the listener stays as gloo left
it and a warning says so.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import sys
import threading

log = logging.getLogger(__name__)

# One TP group construction at a time in a process: its listener diff must be its own.
CONSTRUCTION_LOCK = threading.Lock()

_SO_ATTACH_FILTER = 26  # Linux, every architecture
_BPF_RET_K = 0x06       # BPF_RET | BPF_K: return the constant (0 = drop the packet)
_LOOPBACK_V4 = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it (gloo's device binds it)


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def listening_fds() -> dict[int, int]:
    """fd -> port of this process's listening TCP sockets on 127.0.0.1 (empty off Linux)."""
    if not sys.platform.startswith("linux"):
        return {}
    inode_fd: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inode_fd[link[8:-1]] = int(fd)
    out: dict[int, int] = {}
    try:
        with open("/proc/net/tcp") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return {}
    for row in rows:
        cols = row.split()
        local, state, inode = cols[1], cols[3], cols[9]
        hexaddr, hexport = local.split(":")
        if state == "0A" and hexaddr == _LOOPBACK_V4 and inode in inode_fd:  # 0A: LISTEN
            out[inode_fd[inode]] = int(hexport, 16)
    return out


def drop_new_connections(fd: int) -> None:
    """Attach a drop-everything filter to the listening socket behind `fd` (a dup is used, so the
    caller's descriptor is untouched). OSError if the kernel refuses."""
    insns = (_Insn * 1)(_Insn(_BPF_RET_K, 0, 0, 0))
    prog = _Prog(1, insns)
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, bytes(prog))  # the kernel copies insns now
    finally:
        sock.close()


def seal_new_listeners(before: dict[int, int]) -> list[int]:
    """Seal the loopback listeners opened since `before` (a listening_fds() snapshot); returns
    their ports. Call with CONSTRUCTION_LOCK held across the snapshot and the construction."""
    if os.environ.get("TORCH_GLOO_LAZY_INIT", "0") not in ("", "0"):
        return []  # lazy pairs connect on first use: the listeners are still needed
    sealed = []
    for fd, port in listening_fds().items():
        if before.get(fd) == port:
            continue
        try:
            drop_new_connections(fd)
            sealed.append(port)
        except OSError as e:
            log.warning("could not close the TP group's listener on 127.0.0.1:%d to new connections (%s): "
                        "a local process connecting to it in a loop can exhaust this rank's descriptors", port, e)
    return sealed
