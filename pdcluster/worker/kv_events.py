"""The worker's KV-event publisher task: engine prefix-cache events -> CURVE ZMQ PUB.

    engine thread                 event loop (this task, every interval_s)
    BlockPool events --AsyncEngine.take_kv_events()-->
        KVEventPublisher.publish (bounded batches, seq+1 each)  --> routers' SUB sockets
        --> mirror set (hashes stored and not removed, as of the last published seq)
    snapshot requests (ROUTER socket) are answered from the mirror; heartbeats re-send the seq.

Why a mirror instead of reading the block pool: a snapshot at seq N must hold exactly what
batches <= N built (pdcluster/worker/kv_events_pub.py). The mirror is updated by the very
events that were published, in the same thread, so it is consistent with the seq by
construction and snapshots never wait for the engine thread.

No keys, no publisher: there is no plaintext fallback (DESIGN.md section 9).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from pdcluster.engine.async_engine import AsyncEngine
from pdcluster.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdcluster.security.curve import CurveAuthenticator
from pdcluster.security.envelope import MalformedMessage
from pdcluster.security.keys import (
    KeyMaterialError,
    KeyPair,
    keypair_from_string,
    load_allowed_public_keys,
    load_keypair,
    normalize_public_key,
)
from pdcluster.worker.kv_events_pub import KVEventPublisher
from pdcluster.worker.worker_stats import KVEventsInfo

log = logging.getLogger(__name__)

ENV_WORKER_KEY = "PDCLUSTER_WORKER_KEY"  # "PUBLIC,SECRET" (Z85), see security/keys.py
ENV_ALLOWED_KEYS = "PDCLUSTER_KV_EVENTS_ALLOWED"  # comma-separated Z85 public keys


@dataclass(frozen=True)
class KVEventsConfig:
    keypair: KeyPair  # the worker's CURVE server key pair (with its secret)
    allowed: Mapping[str, bytes]  # subscribers admitted (routers): name -> Z85 public key
    bind_host: str = "127.0.0.1"
    advertise_host: str | None = None  # host put in the reported endpoints (default: bind_host)
    interval_s: float = 0.05
    heartbeat_s: float = 1.0
    # From a key folder: the allow-list follows it (security/rotation.py), names as allow_names.
    key_dir: str | None = None
    allow_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.keypair.has_secret:
            raise KeyMaterialError("KV events: the worker key pair needs its secret key")
        if not self.allowed:
            raise KeyMaterialError("KV events: the allow-list of subscriber keys is empty")

    @classmethod
    def from_key_dir(cls, key_dir: str | os.PathLike[str], *, key_name: str = "worker",
                     allow_names: Sequence[str] = ("router",), **kwargs: Any) -> KVEventsConfig:
        """Keys made by `pdcluster keys init DIR`: this worker's pair, routers' public keys."""
        public = load_allowed_public_keys(key_dir)
        allowed = {n: public[n] for n in allow_names if n in public}
        if not allowed:
            raise KeyMaterialError(f"KV events: none of the subscriber keys {list(allow_names)} is in {key_dir}/public")
        return cls(load_keypair(key_dir, key_name), allowed, key_dir=str(key_dir),
                   allow_names=tuple(allow_names), **kwargs)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> KVEventsConfig | None:
        """From PDCLUSTER_WORKER_KEY and PDCLUSTER_KV_EVENTS_ALLOWED; None when unset."""
        env = os.environ if env is None else env
        if not env.get(ENV_WORKER_KEY):
            return None
        keys = [k.strip() for k in env.get(ENV_ALLOWED_KEYS, "").split(",") if k.strip()]
        allowed = {normalize_public_key(k).decode()[:8]: normalize_public_key(k) for k in keys}
        return cls(keypair_from_string(env[ENV_WORKER_KEY], "worker"), allowed, **kwargs)


class KVEventService:
    def __init__(self, engine: AsyncEngine, config: KVEventsConfig, publisher_id: str, epoch: int) -> None:
        """Binds the sockets now (so endpoints are known); start() runs it."""
        self.engine = engine
        self.config = config
        self._ctx = zmq.Context()
        self._auth = CurveAuthenticator(self._ctx).start()
        addr = f"tcp://{config.bind_host}:*"
        try:
            self.publisher = KVEventPublisher(
                self._ctx, self._auth, config.keypair, config.allowed, publisher_id, self._snapshot,
                epoch=epoch, events_addr=addr, snapshot_addr=addr)
        except BaseException:
            self._auth.stop()
            self._ctx.term()
            raise
        self._watcher = None
        # Set by the watcher's thread, applied by the event loop (zmq sockets are single-thread).
        self._reopen_with: Mapping[str, bytes] | None = None
        if config.key_dir:  # rotation: a revoked router key is refused without a restart
            from pdcluster.security.rotation import KeyDirWatcher

            self._watcher = KeyDirWatcher(self._auth, {s: config.key_dir for s in self.publisher.server_sockets},
                                          only=config.allow_names, on_revoked=self._on_revoked).start()
        self._mirror: set[bytes] = set()
        self._last_send = 0.0
        self._task: asyncio.Task | None = None
        self._pending: asyncio.Future | None = None

    @property
    def refusals(self) -> Any:
        return self._auth.metrics

    def info(self) -> KVEventsInfo:
        return KVEventsInfo(self._advertise(self.publisher.events_endpoint),
                            self._advertise(self.publisher.snapshot_endpoint),
                            self.publisher.public_key, self.publisher.epoch, self.publisher.seq)

    def _advertise(self, endpoint: str) -> str:
        host = self.config.advertise_host
        if not host:
            return endpoint
        port = endpoint.rsplit(":", 1)[1]
        return f"tcp://{host}:{port}"

    def _snapshot(self) -> Iterable[bytes]:
        return tuple(self._mirror)

    def _on_revoked(self, sock: object, allowed: Mapping[str, bytes], gone: list[str]) -> None:
        # The snapshot ROUTER drops a revoked session's requests itself (session_allowed); the
        # PUB socket has to be replaced to end its sessions (KVEventPublisher.reopen_events).
        if sock is self.publisher.server_sockets[0]:
            self._reopen_with = dict(allowed)

    def apply_revocations(self) -> None:
        """Close revoked subscribers' live sessions (the watcher found a key removed)."""
        allowed, self._reopen_with = self._reopen_with, None
        if allowed is None:
            return
        old = self.publisher.server_sockets[0]
        new = self.publisher.reopen_events(allowed)
        if self._watcher is not None:
            self._watcher.replace_socket(old, new)

    # -- the task -------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pdcluster-kv-events")

    async def _run(self) -> None:
        while True:
            try:
                self._tick()
            except Exception:  # a bad tick must not end publishing for the worker's lifetime
                log.exception("KV event publisher tick failed")
            await asyncio.sleep(self.config.interval_s)

    def _tick(self) -> None:
        # The engine call is kept across ticks (never timed out and dropped): events it takes
        # exist nowhere else, so losing them would make the mirror and the routers diverge.
        self.apply_revocations()
        if self._pending is None and self.engine.is_healthy:
            self._pending = asyncio.ensure_future(self.engine.take_kv_events())
        if self._pending is not None and self._pending.done():
            fut, self._pending = self._pending, None
            if fut.exception() is None:
                self.publish(fut.result())
            else:
                log.error("taking KV events failed: %r", fut.exception())
        self.publisher.serve_snapshots(0)
        if time.monotonic() - self._last_send >= self.config.heartbeat_s:
            self.publisher.heartbeat()
            self._last_send = time.monotonic()

    def publish(self, events: Sequence[KVEvent]) -> None:
        if not events:
            return
        try:
            self.publisher.publish(events)  # splits into bounded batches, seq + 1 each
        except MalformedMessage as e:
            # Unpublishable events would leave subscribers believing in blocks we may no longer
            # have: tell everyone to forget this worker's blocks instead (under-estimating is
            # never wrong).
            log.error("KV events could not be encoded (%s); publishing a clear", e)
            self._mirror.clear()
            self.publisher.publish([AllBlocksCleared()])
        else:
            self._apply(events)
        self._last_send = time.monotonic()

    def _apply(self, events: Sequence[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._mirror.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._mirror.difference_update(event.block_hashes)
            else:
                self._mirror.clear()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._pending is not None:
            self._pending.cancel()
        if self._watcher is not None:
            self._watcher.stop()
        # zmq lifecycle: sockets, then the ZAP handler, then the context (term() hangs otherwise).
        self.publisher.close()
        self._auth.stop()
        self._ctx.term()
