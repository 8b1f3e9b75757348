"""What the actors of a Ray cluster get to authenticate each other, as plain strings.

    workers: PDCLUSTER_WORKER_KEY ("PUBLIC,SECRET")      their CURVE pair: KV-event publisher, P2P
             PDCLUSTER_KV_EVENTS_ALLOWED (router key)    who may subscribe to their KV events
             PDCLUSTER_KV_CONNECTOR_OPTIONS (JSON)       the connector's options, with its secrets
    router:  its pair and the workers' public key        KV-event subscriptions

They travel in the actors' start-up arguments and reach serve-worker through its environment
(owner-only /proc/PID/environ), never a command line (world-readable) or a shared file.

Keys come from config.key_dir (`pdcluster keys init`) or are made fresh in a private folder
(0700, secrets 0600) that lives as long as the cluster. For the built-in p2p connector the
launcher fills in what a cluster needs: the workers' pair, the allow-list, a shared secret that
signs kv_transfer_params, and bind addresses on the worker's own host (HOST_PLACEHOLDER, which
each worker actor replaces with the address it binds; usable in any connector's options).
"""

from __future__ import annotations

import json
import pathlib
import secrets
import tempfile
from dataclasses import dataclass

from pdcluster.cluster.config import ClusterConfig

HOST_PLACEHOLDER = "${PDCLUSTER_HOST}"
ENV_WORKER_KEY = "PDCLUSTER_WORKER_KEY"          # read by serve-worker (service/kv_events.py)
ENV_KV_EVENTS_ALLOWED = "PDCLUSTER_KV_EVENTS_ALLOWED"
ENV_CONNECTOR_OPTIONS = "PDCLUSTER_KV_CONNECTOR_OPTIONS"  # read by serve-worker (worker_cmd.py)


@dataclass(frozen=True)
class ClusterSecrets:
    worker_env: dict[str, str]
    router_env: dict[str, str]
    key_dir: str | None  # a folder made here (to remove with the cluster), or None


def cluster_secrets(config: ClusterConfig) -> ClusterSecrets:
    from pdcluster.security.keys import init_keys, keypair_to_string, load_keypair

    made = None
    if config.key_dir:
        router, worker = (load_keypair(config.key_dir, n) for n in ("router", "worker"))
    else:
        made = tempfile.mkdtemp(prefix=f"pdcluster-{config.namespace}-keys-")
        keys = init_keys(pathlib.Path(made) / "keys", ("router", "worker", "client")).keypairs
        router, worker = keys["router"], keys["worker"]
    worker_env = {ENV_WORKER_KEY: keypair_to_string(worker), ENV_KV_EVENTS_ALLOWED: router.public.decode()}
    if config.connector is not None:
        options = dict(config.connector.options)
        if config.connector.name == "p2p":
            options.setdefault("keypair", keypair_to_string(worker))
            options.setdefault("allowed_keys", {"worker": worker.public.decode()})
            options.setdefault("params_secret", secrets.token_hex(32))
            options.setdefault("side_channel_bind", f"tcp://{HOST_PLACEHOLDER}:*")
            options.setdefault("data_host", HOST_PLACEHOLDER)
        worker_env[ENV_CONNECTOR_OPTIONS] = json.dumps(options)
    router_env = {"router": keypair_to_string(router), "worker": worker.public.decode()}
    return ClusterSecrets(worker_env, router_env, made)


def bind_host_into(env: dict[str, str], host: str) -> dict[str, str]:
    """env with HOST_PLACEHOLDER replaced by the worker's bind address (a JSON-safe IP/name)."""
    return {k: v.replace(HOST_PLACEHOLDER, host) for k, v in env.items()}
