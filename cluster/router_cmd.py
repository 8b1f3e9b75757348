"""`pdcluster router` (the router alone in front of running workers) and what `serve` shares with it:
the router's flags, its RouterConfig from them, the exposure check, and running it in the
foreground until Ctrl-C / SIGTERM with the PDCLUSTER_READY line.

    pdcluster router --workers HOST:PORT,... [--model PATH] [--policy NAME] [--grpc-port] [--http-port]

This module imports only the standard library at import time (`pdcluster --help` stays fast).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

READY_PREFIX = "PDCLUSTER_READY"
POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix_aware")
# router/reasoning.py's parsers, spelled out so that `pdcluster --help` imports no router code.
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")
log = logging.getLogger("pdcluster.serve")


def add_tool_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling flags (router/tool_parsers.py)."""
    p.add_argument("--tool-call-parser", default="hermes",
                   help="how tool_choice auto reads calls out of an answer: hermes (default), llama3_json, mistral, "
                        "pythonic, or a plugin's package.module:function (vLLM's flag)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: tool_choice auto is always served here")


def add_generation_config_flag(p: argparse.ArgumentParser, default: str | None = "auto") -> None:
    p.add_argument("--generation-config", default=default,
                   help="sampling defaults for fields a request leaves out: auto (the model's generation_config.json, "
                        "the default), vllm (none) or a folder holding one (vLLM's flag)")


def add_router_flags(p: argparse.ArgumentParser, *, grpc_port: int = 50051, http_port: int = 8000) -> None:
    p.add_argument("--model", default=None, help="model directory (tokenizer); default: from the workers")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name(s) clients use, all listed (default: --model)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or the template text) used instead of the model's own")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES, default=None,
                   help="split the model's <think>...</think> thought into message.reasoning (vLLM's flag)")
    add_tool_flags(p)
    add_generation_config_flag(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; others are explicit)")
    p.add_argument("--grpc-port", type=int, default=grpc_port, help="0 picks a free port")
    p.add_argument("--http-port", "--port", dest="http_port", type=int, default=http_port,
                   help="the OpenAI HTTP port (--port: vLLM's name); 0 picks a free port; -1 disables HTTP")
    p.add_argument("--policy", choices=POLICIES, default="prefix_aware")
    p.add_argument("--max-inflight", type=int, default=1024, help="more requests in flight -> RESOURCE_EXHAUSTED")
    p.add_argument("--max-retries", type=int, default=2, help="retries on other workers before the first token")
    p.add_argument("--max-migrations", type=int, default=2,
                   help="after the first token: times a request whose worker failed is resumed on another (0: off)")
    p.add_argument("--stall-timeout", type=float, default=0.0,
                   help="after the first token: seconds without output after which a worker counts as failed "
                        "and the request migrates (0: wait for the deadline)")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between worker health checks")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline of requests that bring none")
    p.add_argument("--key-dir", default=None, help="cluster keys (`pdcluster keys init`): KV events for prefix_aware")
    a = p.add_argument_group("client access")
    a.add_argument("--api-key", nargs="+", default=None,
                   help="clients must send 'Authorization: Bearer KEY' with one of these keys (every HTTP path but "
                        "/health and /metrics) or the "
                        "same 'authorization' "
                        "metadata (gRPC); default $PDCLUSTER_API_KEY (an environment variable stays out of `ps`)")
    a.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host with neither TLS nor an API key (refused otherwise)")
    g = p.add_argument_group("TLS")
    g.add_argument("--tls-cert", "--ssl-certfile", dest="tls_cert", default=None,
                   help="PEM certificate of the router's gRPC and HTTPS frontends")
    g.add_argument("--tls-key", "--ssl-keyfile", dest="tls_key", default=None)
    g.add_argument("--tls-ca", "--ssl-ca-certs", dest="tls_ca", default=None,
                   help="CA of client certificates: turns on mutual TLS")
    g.add_argument("--worker-tls-ca", default=None, help="CA of the workers' certificates: TLS to the workers")
    g.add_argument("--worker-tls-cert", default=None, help="client certificate for workers that require mTLS")
    g.add_argument("--worker-tls-key", default=None)
    g.add_argument("--worker-tls-server-name", default=None)
    g.add_argument("--insecure-internal", action="store_true",
                   help="serve: plaintext gRPC between the router and its loopback workers instead of mutual TLS "
                        "under a CA made for the run (the default when no --worker-tls-* is given)")
    p.add_argument("--disagg-threshold", type=int, default=0,
                   help="conditional disaggregation: prompts whose uncached part is at most this many tokens "
                        "are served entirely by a decode worker (0: always disaggregate when both pools exist)")
    p.add_argument("--disagg-max-prefill-backlog", type=int, default=0,
                   help="load-aware disaggregation: while the least busy prefill worker has more than this many "
                        "prompt tokens queued, a decode worker that would finish the prompt before the prefill worker "
                        "could start it prefills it itself (0: never)")
    p.add_argument("--disagg-max-decode-inflight", type=int, default=None,
                   help="with --disagg-max-prefill-backlog: only a decode worker with at most this many requests in "
                        "flight takes such prompts (each prompt it computes stalls every decode running there; "
                        "default: any)")
    p.add_argument("--disagg-mode", choices=("sequential", "concurrent"), default="sequential",
                   help="sequential: the decode leg is sent once the prefill leg returned (default); concurrent: "
                        "both legs at once, the decode worker admits its leg while the prefill runs")
    p.add_argument("--disagg-params-timeout", type=float, default=60.0,
                   help="concurrent mode: how long a decode leg waits for the prefill's KV params (s)")
    p.add_argument("--worker-channel", choices=("stream", "call"), default="stream",
                   help="stream: every request to a worker over one multiplexed stream (default); "
                        "call: one gRPC call per request")
    b = p.add_argument_group("request bounds")
    b.add_argument("--max-stop-token-ids", type=int, default=None, help="per request (default 64)")
    b.add_argument("--max-json-depth", type=int, default=None, help="nesting of HTTP bodies (default 32)")
    b.add_argument("--max-message-bytes", type=int, default=None, help="gRPC messages and HTTP bodies (default 4 MiB)")
    b.add_argument("--params-cache-bytes", type=int, default=None, help="memo of validated sampling parameters")
    b.add_argument("--responses-store-bytes", type=int, default=None,
                   help="memory for stored Responses (store / previous_response_id; default 64 MiB, 0: none)")
    b.add_argument("--max-concurrent-streams", type=int, default=None,
                   help="gRPC calls at once on one client connection (default max-inflight + 64)")
    b.add_argument("--max-http-connections-per-peer", type=int, default=None,
                   help="HTTP connections one client address may hold (default max-inflight + 64; more: 503)")
    b.add_argument("--max-http-requests-per-peer", type=int, default=None,
                   help="HTTP requests one client address may run at once (default max-inflight + 64; more: 429)")
    b.add_argument("--max-images-per-request", type=int, default=None, help="image parts per chat (default 8)")
    b.add_argument("--max-image-bytes", type=int, default=None, help="bytes of one decoded image (default 20 MiB)")
    p.add_argument("--log-level", default="INFO")


_BOUNDS = ("max_stop_token_ids", "max_json_depth", "max_message_bytes", "params_cache_bytes", "responses_store_bytes",
           "max_concurrent_streams", "max_images_per_request", "max_image_bytes",
           "max_http_connections_per_peer", "max_http_requests_per_peer")



def add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run the router alone in front of running workers")
    p.add_argument("--workers", required=True, help="comma-separated HOST:PORT of the workers")
    add_router_flags(p)
    p.set_defaults(func=run_router)


def router_config(args: argparse.Namespace, workers: tuple[str, ...], key_dir: str | None, model: str | None) -> Any:
    from pdcluster.router.config import RouterConfig
    from pdcluster.worker.tls import TLSConfig

    tls = worker_tls = None
    if args.tls_cert or args.tls_key or args.tls_ca:
        tls = TLSConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)
    if args.worker_tls_ca or args.worker_tls_cert or args.worker_tls_key:
        worker_tls = TLSConfig(cert=args.worker_tls_cert, key=args.worker_tls_key, ca=args.worker_tls_ca,
                               server_name=args.worker_tls_server_name)

    import os

    bounds = {name: getattr(args, name) for name in _BOUNDS if getattr(args, name) is not None}
    api_key = tuple(args.api_key) if args.api_key else os.environ.get("PDCLUSTER_API_KEY") or None
    return RouterConfig(
        api_key=api_key, insecure=args.insecure, **bounds,
        workers=workers, model=model, served_model_name=args.served_model_name, policy=args.policy,
        chat_template=args.chat_template,  # the text: check_router_flags read the file
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        generation_config=args.generation_config,
        host=args.host, grpc_port=args.grpc_port, http_port=None if args.http_port < 0 else args.http_port,
        max_inflight=args.max_inflight, max_retries=args.max_retries, max_migrations=args.max_migrations,
        stall_timeout_s=args.stall_timeout,
        health_interval_s=args.health_interval,
        request_timeout_s=args.request_timeout, key_dir=key_dir, tls=tls, worker_tls=worker_tls,
        disagg_min_uncached_tokens=args.disagg_threshold,
        disagg_max_prefill_backlog_tokens=args.disagg_max_prefill_backlog,
        disagg_max_decode_inflight=args.disagg_max_decode_inflight, worker_channel=args.worker_channel,
        disagg_mode=args.disagg_mode, disagg_params_timeout_s=args.disagg_params_timeout)


def check_router_flags(args: argparse.Namespace) -> None:
    """Before anything starts: a non-loopback --host needs TLS, an API key or --insecure; and
    --chat-template is read and compiled (args.chat_template then holds the template text)."""
    import os

    from pdcluster.engine.tokenizer import load_chat_template
    from pdcluster.router.auth import check_exposure

    check_exposure(args.host, tls=bool(args.tls_cert), insecure=args.insecure,
                   api_key=bool(args.api_key or os.environ.get("PDCLUSTER_API_KEY")))
    if args.chat_template is not None:
        args.chat_template = load_chat_template(args.chat_template)
    check_tool_call_parser(args.tool_call_parser)
    if args.generation_config not in ("auto", "vllm"):  # a folder: read now ("auto" needs the model)
        from pdcluster.generation_defaults import load_generation_defaults

        load_generation_defaults(args.generation_config, None)
    # A taken port is found now, not after the workers loaded the model (the router binds last).
    for flag, port in (("--grpc-port", args.grpc_port), ("--http-port", args.http_port)):
        check_port_free(args.host, port, flag)


def check_tool_call_parser(name: str) -> None:
    """ValueError naming --tool-call-parser when it resolves to no parser (before workers start)."""
    from pdcluster.router.tool_parsers import TOOL_CALL_PARSERS

    try:
        TOOL_CALL_PARSERS.get(name)
    except ValueError as e:
        raise ValueError(f"--tool-call-parser: {e}") from None


def check_port_free(host: str, port: int, flag: str) -> None:
    """ValueError naming the flag when host:port cannot be bound (taken, or not this machine's
    address). Binds as the servers do (SO_REUSEADDR, no SO_REUSEPORT) and lets go at once; 0 and
    negative ports (free / disabled) are not checked."""
    import socket

    if port <= 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror or e}); "
                             "pick another port, or 0 for a free one") from None


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# -- pdcluster router -------------------------------------------------------------------------
def run_router(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    check_router_flags(args)
    from pdcluster.router.config import parse_worker_list

    config = router_config(args, parse_worker_list(args.workers), args.key_dir, args.model)
    return run_router_foreground(config, wait_for_workers=0)


DEMO_PROMPT = "The prefill pool reads the whole prompt"


async def demo_request(grpc_address: str, api_key: str | None = None) -> None:
    """Stream one request through the router with the real client, as a user would."""
    from pdcluster.client import AsyncClient, ClientError
    from pdcluster.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=48, ignore_eos=True)
    print(f"\ndemo request via {grpc_address}:\n{DEMO_PROMPT}", end="", flush=True)
    try:
        async with AsyncClient(grpc_address, timeout=120.0, api_key=api_key) as client:
            async for delta in client.generate_stream(DEMO_PROMPT, params):
                print(delta.text, end="", flush=True)
    except ClientError as e:
        print(f"\ndemo request failed: {e}", file=sys.stderr)
        return
    print("\n(cluster stays up; Ctrl-C stops it)", flush=True)


def run_router_foreground(config: Any, *, wait_for_workers: int, launcher: Any = None,
                          send_demo: bool = False, ready_extra: dict[str, Any] | None = None) -> int:
    """Run the router until SIGINT/SIGTERM. With a launcher, its workers are stopped first (SIGTERM:
    each drains, its running requests finish and stream out through the still-running router),
    then the router."""
    import asyncio
    import signal

    from pdcluster.router.app import Router

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        router = Router(config)
        await router.start()
        try:
            if wait_for_workers:
                await router.registry.wait_for_healthy(wait_for_workers, 30.0)
            _print_ready(router, launcher, ready_extra)
            if send_demo:
                await demo_request(router.endpoints()["grpc"], config.api_key[0] if config.api_key else None)
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
                for p in launcher.newly_exited() if launcher is not None else ():
                    log.error("%s (pid %d) exited unexpectedly: %s", p.name, p.pid, p.status())
            log.info("shutting down")
            if launcher is not None:
                await asyncio.to_thread(launcher.stop)  # the workers drain while the router streams
        finally:
            await router.stop()

    asyncio.run(main())
    return 0


def _print_ready(router: Any, launcher: Any, extra: dict[str, Any] | None = None) -> None:
    ep = router.endpoints()
    if launcher is not None:
        ep["worker_pids"] = [p.pid for p in launcher.processes]
        ep["instances"] = {p.name: p.summary() for p in launcher.processes}
    ep.update(extra or {})
    print(f"pdcluster router: gRPC {ep['grpc']}" + (f", OpenAI HTTP {ep['http']}/v1" if ep["http"] else ""))
    print(f"  model {ep['model']!r}, policy {ep['policy']}, workers {', '.join(ep['workers'])}")
    print(f"{READY_PREFIX} {json.dumps(ep, separators=(',', ':'))}", flush=True)
