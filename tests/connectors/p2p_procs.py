"""Test helpers for connector tests: cluster keys, engine arguments, and EngineProc, the parent
side of engine_proc.py (a real engine process on 127.0.0.1 driven over a pipe)."""

from __future__ import annotations

import glob
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from engine_proc import read_frame, write_frame

from pdcluster.security.keys import KeyPair, generate_keypair, keypair_to_string

ENGINE_PROC = pathlib.Path(__file__).resolve().parent / "engine_proc.py"
PARAMS_SECRET = "c3" * 32


class ClusterKeys:
    def __init__(self) -> None:
        self.pairs: dict[str, KeyPair] = {n: generate_keypair(n) for n in ("producer", "producer2", "producer3", "consumer")}
        self.allowed = {n: kp.public.decode() for n, kp in self.pairs.items()}

    def options(self, name: str, **extra: Any) -> dict[str, Any]:
        return {"keypair": keypair_to_string(self.pairs[name]), "allowed_keys": self.allowed,
                "params_secret": PARAMS_SECRET, **extra}


class EngineProc:
    """Parent side of engine_proc.py: submit requests, wait for them, read stats, kill."""

    def __init__(self, engine_args: dict[str, Any], log_path: pathlib.Path) -> None:
        self._log = open(log_path, "wb")
        env = dict(os.environ, PDCLUSTER_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, str(ENGINE_PROC)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env)
        self.pid = self.proc.pid
        self._lock = threading.Condition()
        self._finished: dict[str, dict[str, Any]] = {}
        self._stats: dict[int, dict[str, Any]] = {}
        self._ready: dict[str, Any] | None = None
        self._tags = iter(range(1 << 30))
        self._log_path = log_path
        threading.Thread(target=self._read, daemon=True).start()
        self._send({"op": "init", "engine_args": engine_args})
        self.meta: dict[str, Any] = {}

    def wait_ready(self, timeout_s: float = 180.0) -> EngineProc:
        with self._lock:
            if not self._lock.wait_for(lambda: self._ready is not None or self.proc.poll() is not None, timeout_s):
                raise TimeoutError(f"engine process {self.pid} not ready after {timeout_s}s (log {self._log_path})")
        if self._ready is None:
            raise RuntimeError(f"engine process {self.pid} died at start; log: {self._log_path.read_text()[-3000:]}")
        self.meta = self._ready["meta"]
        self.tp_pids: list[int] = list(self._ready.get("tp_pids") or [])
        return self

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        write_frame(self.proc.stdin, obj)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while True:
            try:
                msg = read_frame(self.proc.stdout)
            except (OSError, ValueError):
                msg = None
            with self._lock:
                if msg is None:
                    self._lock.notify_all()
                    return
                if msg["event"] == "ready":
                    self._ready = msg
                elif msg["event"] == "finished":
                    self._finished[msg["request_id"]] = msg
                elif msg["event"] == "stats":
                    self._stats[msg["tag"]] = msg["stats"]
                self._lock.notify_all()

    def add(self, reqs: list[dict[str, Any]]) -> None:
        self._send({"op": "add", "reqs": reqs})

    def abort(self, ids: list[str]) -> None:
        self._send({"op": "abort", "ids": ids})

    def wait(self, ids: list[str], timeout_s: float = 120.0) -> dict[str, dict[str, Any]]:
        with self._lock:
            ok = self._lock.wait_for(lambda: all(i in self._finished for i in ids) or self.proc.poll() is not None,
                                     timeout_s)
            missing = [i for i in ids if i not in self._finished]
            if not ok or missing:
                raise AssertionError(f"engine {self.pid}: requests {missing} did not finish in {timeout_s}s "
                                     f"(alive={self.proc.poll() is None})")
            return {i: self._finished.pop(i) for i in ids}

    def stats(self, timeout_s: float = 30.0) -> dict[str, Any]:
        tag = next(self._tags)
        self._send({"op": "stats", "tag": tag})
        with self._lock:
            if not self._lock.wait_for(lambda: tag in self._stats, timeout_s):
                raise AssertionError(f"engine {self.pid} sent no stats in {timeout_s}s")
            return self._stats.pop(tag)

    def wait_stats(self, pred: Any, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.stats()
            if pred(s):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"engine {self.pid}: timed out after {timeout_s}s waiting for {what}: {s}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(30)
        for path in glob.glob(f"/dev/shm/pdcluster-{self.pid}-*"):  # it never got to unlink them
            os.unlink(path)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"op": "stop"})
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self._log.close()


def engine_args(model: str, role: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    args: dict[str, Any] = {"model": model, "num_kv_blocks": 128, "max_model_len": 256, "block_size": 16,
                            "max_num_seqs": 16, "seed": 0}
    if role is not None:
        args.update(kv_connector="p2p", kv_role=role, kv_connector_options=options)
    return args
