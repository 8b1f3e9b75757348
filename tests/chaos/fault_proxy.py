"""A userspace TCP fault proxy for chaos tests (asyncio, loopback only: 127.0.0.1 unless a test
names another 127.x address, e.g. where a peer announces 127.0.0.2:PORT for its own 127.0.0.1:PORT).

A test puts it between two peers (router -> worker gRPC, consumer -> producer data plane, worker
-> kvstore master) by handing the client the proxy's address instead of the server's; the proxy
forwards bytes both ways until a fault is armed. Faults switch at run time (from any thread), so a
test arms one mid-request, at a point it chose (after the client read k tokens, while a request is
held at a mark), never after a sleep:

    delay(ms)                 every chunk waits ms before it is forwarded
    bandwidth(bytes_per_s)    each direction forwards at most that rate
    blackhole()               accept and read, never forward (existing connections too)
    reset(refuse_new=True)    RST every connection (SO_LINGER 0); new ones too while armed
    corrupt(direction, n)     flip byte n (counted from arming) of that direction, once
    truncate(direction, n)    after n more bytes of that direction, close that connection, once
    corrupt_after(direction, marker, skip)
                              flip the lowest bit of the byte `skip` bytes after the next `marker`
                              seen in that direction (within one chunk), once: on plaintext gRPC,
                              e.g. a token id right after a request id in a reply, which no frame or
                              protobuf check notices (under TLS the marker is never visible)
    clear()                   forward again; connections that lost bytes to a blackhole are reset
                              (their byte stream is broken for good, as on a real network)

Directions: "up" is client -> server, "down" server -> client. Counters per direction: bytes read
(`received`), forwarded (`forwarded`), dropped; connections accepted, reset, corrupted, truncated.
Stop with close() (a fixture finalizer): the listener, every connection and the loop thread end.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DIRECTIONS = ("up", "down")
_CHUNK = 65536
_BW_SLICE = 1024  # bandwidth mode forwards in slices this big, so the rate holds within a chunk


@dataclass
class ProxyCounters:
    received: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    forwarded: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    connections: int = 0
    resets: int = 0
    corrupted: int = 0
    truncated: int = 0

    def snapshot(self) -> dict[str, Any]:
        return {"received": dict(self.received), "forwarded": dict(self.forwarded), "dropped": dict(self.dropped),
                "connections": self.connections, "resets": self.resets, "corrupted": self.corrupted,
                "truncated": self.truncated}


@dataclass
class _Fault:
    """The armed fault. Only the proxy's loop thread reads or writes it."""

    mode: str = "pass"  # pass | delay | bandwidth | blackhole | reset
    delay_s: float = 0.0
    rate: float = 0.0
    corrupt: dict[str, int] = field(default_factory=dict)  # direction -> bytes still to pass before the flip
    truncate: dict[str, int] = field(default_factory=dict)  # direction -> bytes still to forward
    corrupt_after: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # direction -> (marker, skip)


class _Conn:
    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.server: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task] = []
        self.lost_bytes = False  # a blackhole dropped some: the stream cannot be resumed

    def writers(self) -> list[asyncio.StreamWriter]:
        return [w for w in (self.client, self.server) if w is not None]

    def reset(self) -> None:
        """RST both sides: SO_LINGER on with timeout 0, then close without a FIN."""
        for w in self.writers():
            sock = w.get_extra_info("socket")
            try:
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            w.transport.abort()
        for t in self.tasks:
            t.cancel()

    def close(self) -> None:
        for w in self.writers():
            w.close()
        for t in self.tasks:
            t.cancel()


class FaultProxy:
    """Listens on `host`:`port` (127.0.0.1, 0 = a free port) and forwards to `upstream` (host, port)."""

    def __init__(self, upstream: tuple[str, int] | str, port: int = 0, host: str = "127.0.0.1") -> None:
        assert host.startswith("127."), "loopback only"
        if isinstance(upstream, str):
            host, _, p = upstream.rpartition(":")
            upstream = (host, int(p))
        self.upstream = upstream
        self.counters = ProxyCounters()
        self._fault = _Fault()
        self._conns: set[_Conn] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"fault-proxy-{upstream[1]}", daemon=True)
        self._thread.start()
        self._server = self._call(lambda: asyncio.start_server(self._accept, host, port))
        self.address = self._server.sockets[0].getsockname()[:2]
        self._closed = False

    @property
    def addr(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    # -- switching faults (any thread) ------------------------------------------------------------
    def _call(self, make: Callable[[], Any], timeout: float = 30.0) -> Any:
        async def run() -> Any:
            out = make()
            return await out if asyncio.iscoroutine(out) else out

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def delay(self, ms: float) -> None:
        self._call(lambda: self._set(mode="delay", delay_s=ms / 1000.0))

    def bandwidth(self, bytes_per_s: float) -> None:
        self._call(lambda: self._set(mode="bandwidth", rate=float(bytes_per_s)))

    def blackhole(self) -> None:
        self._call(lambda: self._set(mode="blackhole"))

    def reset(self, refuse_new: bool = True) -> None:
        def arm() -> None:
            self._set(mode="reset" if refuse_new else "pass")
            for c in list(self._conns):
                self._reset(c)

        self._call(arm)

    def corrupt(self, direction: str, offset: int = 0) -> None:
        assert direction in DIRECTIONS
        self._call(lambda: self._fault.corrupt.__setitem__(direction, offset))

    def corrupt_after(self, direction: str, marker: bytes, skip: int = 0) -> None:
        assert direction in DIRECTIONS and marker
        self._call(lambda: self._fault.corrupt_after.__setitem__(direction, (bytes(marker), skip)))

    def truncate(self, direction: str, nbytes: int = 0) -> None:
        assert direction in DIRECTIONS
        self._call(lambda: self._fault.truncate.__setitem__(direction, nbytes))

    def clear(self) -> None:
        def arm() -> None:
            self._fault = _Fault()
            for c in [c for c in self._conns if c.lost_bytes]:
                self._reset(c)

        self._call(arm)

    def snapshot(self) -> dict[str, Any]:
        return self._call(self.counters.snapshot)

    def num_connections(self) -> int:
        return self._call(lambda: len(self._conns))

    def _set(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self._fault, k, v)

    def _reset(self, c: _Conn) -> None:
        self.counters.resets += 1
        c.reset()
        self._conns.discard(c)

    # -- forwarding (the loop thread) ---------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counters.connections += 1
        c = _Conn(writer)
        self._conns.add(c)
        if self._fault.mode == "reset":
            self._reset(c)
            return
        if self._fault.mode == "blackhole":  # never even reach the server: read and drop
            c.lost_bytes = True
            c.tasks.append(asyncio.current_task())  # type: ignore[arg-type]
            await self._pump(c, reader, None, "up")
            return
        try:
            sreader, swriter = await asyncio.open_connection(*self.upstream)
        except OSError:
            self._reset(c)
            return
        c.server = swriter
        c.tasks = [asyncio.ensure_future(self._pump(c, reader, swriter, "up")),
                   asyncio.ensure_future(self._pump(c, sreader, writer, "down"))]

    async def _pump(self, c: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None,
                    direction: str) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                self.counters.received[direction] += len(data)
                if not await self._forward(c, data, writer, direction):
                    return
        except (OSError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            return
        # One side ended: end the other (a FIN each way, as a plain TCP hop does).
        if c in self._conns:
            self._conns.discard(c)
            c.close()

    async def _forward(self, c: _Conn, data: bytes, writer: asyncio.StreamWriter | None, direction: str) -> bool:
        f = self._fault
        if f.mode == "blackhole" or writer is None:
            self.counters.dropped[direction] += len(data)
            c.lost_bytes = True
            return True
        armed = f.corrupt_after.get(direction)
        if armed is not None:
            found = data.find(armed[0])
            at = found + len(armed[0]) + armed[1]
            if found >= 0 and at < len(data):
                data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]  # one bit: the subtle case
                del f.corrupt_after[direction]
                self.counters.corrupted += 1
        if direction in f.corrupt:
            at = f.corrupt[direction]
            if at < len(data):
                data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
                del f.corrupt[direction]
                self.counters.corrupted += 1
            else:
                f.corrupt[direction] = at - len(data)
        cut = False
        if direction in f.truncate:
            left = f.truncate[direction]
            if left < len(data):
                data, cut = data[:left], True
                del f.truncate[direction]
            else:
                f.truncate[direction] = left - len(data)
        if f.mode == "delay":
            await asyncio.sleep(f.delay_s)
        if f.mode == "bandwidth" and f.rate > 0:
            for i in range(0, len(data), _BW_SLICE):
                piece = data[i:i + _BW_SLICE]
                await asyncio.sleep(len(piece) / f.rate)
                writer.write(piece)
                await writer.drain()
                self.counters.forwarded[direction] += len(piece)
        elif data:
            writer.write(data)
            await writer.drain()
            self.counters.forwarded[direction] += len(data)
        if cut:
            self.counters.truncated += 1
            self._conns.discard(c)
            c.close()
            return False
        return True

    # -- stopping -----------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            self._server.close()
            for c in list(self._conns):
                c.reset()
            self._conns.clear()
            await self._server.wait_closed()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self._call(stop, timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
