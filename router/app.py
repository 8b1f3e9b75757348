"""Router: wires one router together -- registry, policy, KV-event sync, preprocessor,
orchestrator, metrics -- and runs its gRPC and HTTP frontends on one event loop.

    router = Router(config); await router.start(); ...; await router.stop()

No torch anywhere in this process: the tokenizer is the `tokenizers`-only one from the core.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import os
import ssl
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.generation_defaults import load_generation_defaults
from pdcluster.security.keys import load_allowed_public_keys, load_keypair
from pdcluster.security.tls_audit import HandshakeAudit
from pdcluster.worker.tls import TLSConfig

from .admission import Admission
from .auth import check_exposure
from .config import RouterConfig
from .http_server import RUNNER_ARGS, HttpFrontend
from .kv_sync import KVEventSync
from .metrics import RouterMetrics
from .openai_images import ImageLimits, load_image_placeholders
from .orchestrator import Orchestrator
from .policies import PrefixAware, RoutingPolicy, make_policy
from .prefix_index import PrefixIndex
from .preprocess import Preprocessor
from .registry import WorkerRegistry
from .server import RouterHealth, RouterServicer, build_grpc_server
from .tls_reload import HttpsCertReloader, HttpsReloadCollector, https_server_context

log = logging.getLogger(__name__)


class Router:
    def __init__(self, config: RouterConfig, *, tokenizer: Tokenizer | None = None,
                 metrics_registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.metrics = RouterMetrics(metrics_registry)
        self._tokenizer = tokenizer
        self.kv_sync: KVEventSync | None = None
        self.index = PrefixIndex()
        self.policy: RoutingPolicy = _make_policy(config, self.index)
        self.registry: WorkerRegistry | None = None
        self.preprocessor: Preprocessor | None = None
        self.orchestrator: Orchestrator | None = None
        self.admission: Admission | None = None
        self.health: RouterHealth | None = None
        self._grpc_server = None
        self._http_runner: web.AppRunner | None = None
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._https_reload: asyncio.Task | None = None
        self.tls_audit: HandshakeAudit | None = None  # refused handshakes on the gRPC frontend (TLS only)

    async def start(self) -> None:
        cfg = self.config
        check_exposure(cfg.host, tls=cfg.tls is not None, api_key=cfg.api_key is not None, insecure=cfg.insecure)
        if cfg.key_dir:
            keypair = load_keypair(cfg.key_dir, cfg.key_name)
            allowed = set(load_allowed_public_keys(cfg.key_dir).values())
            self.kv_sync = KVEventSync(keypair, self.index, allowed_publisher_keys=allowed,
                                       poll_interval_s=cfg.kv_poll_interval_s)
            self.kv_sync.start()
        self.registry = WorkerRegistry(cfg, kv_sync=self.kv_sync, on_change=self._on_workers_changed)
        self.health = RouterHealth(self.registry)
        self.metrics.attach(self.registry, self.kv_sync)
        try:
            await self.registry.start()
            model = await self._model_path()
            # The path asked of a worker is the model's from now on (/v1/models' `root`).
            self.config = cfg = dataclasses.replace(cfg, model=model)
            tokenizer = self._tokenizer or await asyncio.to_thread(Tokenizer.from_pretrained, model)
            if cfg.chat_template is not None:
                tokenizer.chat_template = cfg.chat_template
            self.preprocessor = Preprocessor(tokenizer, served_model_names=_served_names(cfg, model),
                                             max_stop_token_ids=cfg.max_stop_token_ids,
                                             params_cache_bytes=cfg.params_cache_bytes, **_model_limits(model),
                                             image_placeholders=load_image_placeholders(model),
                                             image_limits=ImageLimits(cfg.max_images_per_request, cfg.max_image_bytes),
                                             max_message_bytes=cfg.max_message_bytes,
                                             max_json_depth=cfg.max_json_depth,
                                             generation_defaults=load_generation_defaults(cfg.generation_config, model))
            self.orchestrator = Orchestrator(cfg, self.registry, self.policy, self.metrics)
            self.admission = Admission(cfg.max_inflight, self.orchestrator, self.metrics)
            self._on_workers_changed()
            servicer = RouterServicer(cfg, self.preprocessor, self.orchestrator, self.registry, self.admission)
            if cfg.tls is not None:  # client-facing TLS: refused handshakes counted, peers named
                self.tls_audit = HandshakeAudit("router")
            self._grpc_server, self.grpc_port = build_grpc_server(cfg, servicer, self.health, self.tls_audit)
            if self.tls_audit is not None:
                self.metrics.registry.register(self.tls_audit.start(self.grpc_port))
            await self._grpc_server.start()
            if cfg.http_port is not None:
                await self._start_http()
        except BaseException:
            await self.stop()
            raise
        # What startup loaded (modules, grpc, aiohttp, tokenizer, jinja2: ~50k objects) lives as
        # long as the process. Frozen, it is left out of the cyclic GC's full collections, which
        # otherwise walk all of it every few seconds under load: measured ~60 us per request
        # amortised at ~2,000 req/s, and each one a pause of tens of ms for every request in flight.
        gc.collect()
        gc.freeze()
        log.info("router up: grpc %s, http %s, %d worker(s), policy %s", self.grpc_address, self.http_url,
                 len(self.registry.handles), cfg.policy)

    async def _model_path(self) -> str:
        if self.config.model:
            return self.config.model
        assert self.registry is not None
        if not await self.registry.wait_for_healthy(1, self.config.worker_wait_timeout_s):
            raise RuntimeError(f"no worker answered within {self.config.worker_wait_timeout_s:g}s and no --model "
                               "was given: the router needs the model's tokenizer")
        info = self.registry.first_info()
        assert info is not None
        if not Path(info.model).is_dir():
            raise RuntimeError(f"worker serves model {info.model!r}, which is not a directory here; pass --model")
        return info.model

    async def _start_http(self) -> None:
        assert self.preprocessor and self.orchestrator and self.registry
        from .peer_limits import PeerLimits

        limits = PeerLimits(self.config.http_connections_per_peer, self.config.http_requests_per_peer,
                            self.metrics.registry)
        frontend = HttpFrontend(self.config, self.preprocessor, self.orchestrator, self.registry, self.metrics,
                                self.admission, peer_limits=limits)
        runner = web.AppRunner(frontend.app(), **RUNNER_ARGS)
        await runner.setup()
        assert runner.server is not None
        limits.install(runner.server)
        self._http_runner = runner
        ssl_ctx = _ssl_context(self.config.tls) if self.config.tls else None
        # a reissued certificate or a changed client-CA bundle, no restart (tls_reload.py)
        reloader = HttpsCertReloader(ssl_ctx, self.config.tls) if ssl_ctx is not None and self.config.tls else None
        if reloader is not None:
            reloader.install(runner.server)  # before serving: resumed sessions are checked from the start
            self.metrics.registry.register(HttpsReloadCollector(reloader))
        site = web.TCPSite(runner, self.config.host, self.config.http_port, reuse_port=False, ssl_context=ssl_ctx)
        try:
            await site.start()
        except OSError as e:  # the gRPC port's failure says the same (server.build_grpc_server)
            raise OSError(e.errno, f"cannot bind the router's HTTP port {self.config.host}:{self.config.http_port}: "
                                   f"{e.strerror or e}") from None
        if reloader is not None:
            self._https_reload = asyncio.get_running_loop().create_task(self._reload_https(reloader),
                                                                        name="https-cert-reload")
        self.http_port = runner.addresses[0][1]

    async def _reload_https(self, reloader: HttpsCertReloader) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                reloader.check()
            except Exception:  # a bad reload keeps the current certificate and the loop
                log.exception("HTTPS certificate reload failed")

    def _on_workers_changed(self) -> None:
        if self.health is not None:
            self.health.update()
        if self.preprocessor is not None and self.registry is not None:
            # The engines' own limit wins over config.json's: they may have been started shorter.
            lens = [h.info.max_model_len for h in self.registry.handles if h.info is not None and h.info.max_model_len]
            if lens:
                self.preprocessor.max_model_len = min(lens)

    @property
    def grpc_address(self) -> str:
        return f"{self.config.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str | None:
        scheme = "https" if self.config.tls else "http"
        return None if self.http_port is None else f"{scheme}://{self.config.host}:{self.http_port}"

    def endpoints(self) -> dict[str, object]:
        return {"grpc": self.grpc_address, "http": self.http_url, "policy": self.config.policy,
                "workers": [h.address for h in self.registry.handles] if self.registry else [],
                "model": self.preprocessor.model_name if self.preprocessor else None}

    async def stop(self, grace_s: float = 2.0) -> None:
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace_s)
            self._grpc_server = None
        if self.tls_audit is not None:
            self.tls_audit.stop()
        if self._https_reload is not None:
            self._https_reload.cancel()
            self._https_reload = None
        if self._http_runner is not None:
            await self._http_runner.cleanup()
            self._http_runner = None
        if self.orchestrator is not None:
            await self.orchestrator.close()
        if self.registry is not None:
            await self.registry.stop()
        if self.kv_sync is not None:
            await self.kv_sync.close()
            self.kv_sync = None


def _ssl_context(tls: TLSConfig) -> ssl.SSLContext:
    """HTTPS for the OpenAI frontend from the same PEM files as gRPC; ca= requires client certs."""
    if tls.cert is None or tls.key is None:
        raise ValueError("tls: the router's frontends need cert and key")
    return https_server_context(tls.cert, tls.key, tls.ca)  # one definition: the reloader builds the same


def _make_policy(config: RouterConfig, index: PrefixIndex) -> RoutingPolicy:
    if config.policy == PrefixAware.name:
        return make_policy(config.policy, index=index, load_weight=config.prefix_load_weight)
    return make_policy(config.policy)


def _served_names(config: RouterConfig, model: str) -> list[str]:
    if config.served_model_name:
        return list(dict.fromkeys(config.served_model_name))
    names = [model, os.path.basename(os.path.normpath(model))]
    return list(dict.fromkeys(n for n in names if n))


def _model_limits(model: str) -> dict[str, int | None]:
    """vocab_size and max_model_len from the checkpoint's config.json, when it has one."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return {"vocab_size": None, "max_model_len": None}
    cfg = json.loads(path.read_text(encoding="utf-8"))
    text_cfg = cfg.get("text_config") or cfg  # multimodal configs nest the decoder's
    return {"vocab_size": text_cfg.get("vocab_size"), "max_model_len": text_cfg.get("max_position_embeddings")}
