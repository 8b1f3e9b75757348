"""Store processes on 127.0.0.1 for tests, benchmarks and demos; each one is stopped by its pid.

    with LocalStores(workdir) as stores:
        master = stores.kvstore(node_size="256M")         # `pdcluster kvstore master` + one node
        mc = stores.mooncake(segment_bytes=256 << 20)      # mooncake_master + one storage process

The Mooncake storage process is this module run as a script: a MooncakeDistributedStore that
contributes a segment to the pool and does nothing else, like a kvstore storage node:

    python -m pdcluster.cluster.store_procs mooncake-node --master HOST:PORT --size BYTES
"""

from __future__ import annotations

import glob
import json
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mooncake_master_binary() -> str | None:
    near = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return near if os.access(near, os.X_OK) else shutil.which("mooncake_master")


class LocalStores:
    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.started: list[subprocess.Popen] = []
        self._secret = os.path.join(workdir, "kv.secret")

    def __enter__(self) -> LocalStores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str], ready_json: bool, timeout_s: float = 60.0) -> dict[str, Any]:
        log: IO[bytes] = open(os.path.join(self.workdir, f"{name}-{len(self.started)}.log"), "wb")  # noqa: SIM115
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE if ready_json else log, stderr=log,
                                stdin=subprocess.PIPE, text=ready_json)
        self.started.append(proc)
        if not ready_json:
            return {}
        lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.put(line)
            lines.put("")  # EOF: the process died before it got ready

        threading.Thread(target=pump, daemon=True).start()
        try:
            return json.loads(lines.get(timeout=timeout_s))
        except (queue.Empty, json.JSONDecodeError):
            raise RuntimeError(f"{name} did not get ready; see {log.name}") from None

    def _secret_file(self) -> str:
        if not os.path.exists(self._secret):
            fd = os.open(self._secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        return self._secret

    def kvstore(self, node_size: str = "256M", num_nodes: int = 1, master_args: tuple[str, ...] = (),
                ca: Any = None, node_args: tuple[str, ...] = ()) -> str:
        """A kvstore master plus storage nodes (through the `pdcluster kvstore` CLI); its address.
        ca: a pdcluster.security.pki.ClusterCA: mutual TLS, each process with its own certificate.
        master_args / node_args: more flags for the master / every node (e.g. --metrics-port 0)."""
        cli = [sys.executable, "-m", "pdcluster.cluster.cli", "kvstore"]
        tls: list[str] = []
        if ca is not None:
            m = ca.issue("kvstore-master", "kvstore-master")
            tls = ["--tls-cert", m.cert, "--tls-key", m.key, "--tls-client-ca", m.ca]
        ready = self._spawn("kvstore-master", [*cli, "master", "--port", "0", "--secret-file", self._secret_file(),
                                               *tls, *master_args], ready_json=True)
        for i in range(num_nodes):
            node_id = f"node{i}-{os.getpid()}"
            node_tls: list[str] = []
            if ca is not None:
                n = ca.issue("kvstore-node", node_id)
                node_tls = ["--tls-ca", n.ca, "--tls-cert", n.cert, "--tls-key", n.key]
            self._spawn("kvstore-node", [*cli, "node", "--master", ready["address"], "--size", node_size,
                                         "--node-id", node_id, "--secret-file", self._secret, *node_tls,
                                         *node_args],
                        ready_json=True)
        return str(ready["address"])

    def mooncake(self, segment_bytes: int = 256 << 20, timeout_s: float = 30.0) -> str:
        """mooncake_master (metadata by P2P handshake) plus one storage process; its address."""
        binary = mooncake_master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not found (pip install 'pdcluster[mooncake]')")
        port = free_port()
        self._spawn("mooncake-master", [binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                                        f"--metrics_port={free_port()}", "--metrics_host=127.0.0.1"],
                    ready_json=False)
        addr = f"127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.started[-1].poll() is not None:
                    raise RuntimeError(f"mooncake_master did not start; see {self.workdir}") from None
                time.sleep(0.05)
        self._spawn("mooncake-node", [sys.executable, "-m", "pdcluster.cluster.store_procs", "mooncake-node",
                                      "--master", addr, "--size", str(segment_bytes)], ready_json=True)
        return addr

    def stop(self) -> None:
        for proc in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            # A killed kvstore node cannot unlink its segments: remove our own children's only.
            from pdcluster.transfer.region import shm_dir

            for path in glob.glob(os.path.join(shm_dir(), f"pdcluster-{proc.pid}-*")):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        self.started.clear()


def _mooncake_node(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="mooncake-node")
    parser.add_argument("--master", required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(args.host, "P2PHANDSHAKE", args.size, 16 << 20, "tcp", "", args.master)
    if code != 0:
        print(json.dumps({"event": "error", "code": code}), flush=True)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(json.dumps({"event": "mooncake_node_ready", "master": args.master}), flush=True)
    # Also stop when the parent goes away (our stdin closes): never outlive the test or benchmark.
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    stop.wait()
    store.close()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["mooncake-node"]:
        sys.exit(_mooncake_node(sys.argv[2:]))
    sys.exit("usage: python -m pdcluster.cluster.store_procs mooncake-node --master HOST:PORT --size BYTES")
