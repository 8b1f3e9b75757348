"""An on-path TCP proxy for integrity tests: forwards both ways, and while `armed` flips one byte
of what the server sends back on each connection: `flip_at` bytes after the first byte it
forwards once armed (so a pooled connection is tampered as well as a fresh one)."""

from __future__ import annotations

import socket
import threading


class TamperProxy:
    def __init__(self, upstream: tuple[str, int], flip_at: int = 100) -> None:
        self.upstream = upstream
        self.flip_at = flip_at
        self.armed = threading.Event()
        self.flipped = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            server = socket.create_connection(self.upstream)
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, tamper: bool) -> None:
        seen = 0
        target: int | None = None  # stream offset to flip while armed
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if not (tamper and self.armed.is_set()):
                    target = None
                elif target is None:
                    target = seen + self.flip_at
                if target is not None and seen <= target < seen + len(data):
                    buf = bytearray(data)
                    buf[target - seen] ^= 0x01
                    data = bytes(buf)
                    with self._lock:
                        self.flipped += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
