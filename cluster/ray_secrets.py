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
import logging
import pathlib
import secrets
import tempfile
from dataclasses import dataclass, field

from pdcluster.cluster.config import ClusterConfig

HOST_PLACEHOLDER = "${PDCLUSTER_HOST}"
ENV_WORKER_KEY = "PDCLUSTER_WORKER_KEY"          # read by serve-worker (service/kv_events.py)
ENV_KV_EVENTS_ALLOWED = "PDCLUSTER_KV_EVENTS_ALLOWED"
ENV_CONNECTOR_OPTIONS = "PDCLUSTER_KV_CONNECTOR_OPTIONS"  # read by serve-worker (worker_cmd.py)
ENV_EC_OPTIONS = "PDCLUSTER_EC_CONNECTOR_OPTIONS"  # read by serve-worker (worker_cmd.py)
log = logging.getLogger("pdcluster.ray")


@dataclass(frozen=True)
class ClusterSecrets:
    worker_env: dict[str, str]
    router_env: dict[str, str]
    key_dir: str | None  # a folder made here (to remove with the cluster), or None
    # Per worker instance, over worker_env: its own CURVE pair (KV events, P2P), so servers tell
    # the instances apart (the P2P lease owner is the consumer's key name).
    instance_env: dict[str, dict[str, str]] = field(default_factory=dict)

    def for_instance(self, name: str) -> dict[str, str]:
        return {**self.worker_env, **self.instance_env.get(name, {})}


def instance_names(config: ClusterConfig) -> list[str]:
    """The worker instances' names, as placement.InstancePlan.name spells them."""
    return [f"{role}-{i}" for role, pool in config.pools.items() for i in range(pool.instances)]


def cluster_secrets(config: ClusterConfig) -> ClusterSecrets:
    from pdcluster.security.keys import (
        KeyMaterialError,
        ensure_instance_keys,
        init_keys,
        keypair_to_string,
        load_keypair,
    )

    made = None
    names = instance_names(config)
    if config.key_dir:
        router, worker = (load_keypair(config.key_dir, n) for n in ("router", "worker"))
        try:  # their own pairs, made in the folder when missing (as `serve --key-dir` does)
            pairs = ensure_instance_keys(config.key_dir, names)
        except (OSError, KeyMaterialError) as e:
            log.warning("workers share the 'worker' key pair of %s (no per-instance pairs: %s)", config.key_dir, e)
            pairs = {n: worker for n in names}
    else:
        made = tempfile.mkdtemp(prefix=f"pdcluster-{config.namespace}-keys-")
        keys = init_keys(pathlib.Path(made) / "keys", ("router", "worker", "client", *names)).keypairs
        router, worker = keys["router"], keys["worker"]
        pairs = {n: keys[n] for n in names}
    worker_env = {ENV_WORKER_KEY: keypair_to_string(worker), ENV_KV_EVENTS_ALLOWED: router.public.decode()}
    instance_env: dict[str, dict[str, str]] = {n: {ENV_WORKER_KEY: keypair_to_string(kp)} for n, kp in pairs.items()}
    if config.connector is not None:
        options = dict(config.connector.options)
        if config.connector.name == "p2p":
            options.setdefault("allowed_keys", {kp.name: kp.public.decode() for kp in pairs.values()})
            options.setdefault("params_secret", secrets.token_hex(32))
            options.setdefault("side_channel_bind", f"tcp://{HOST_PLACEHOLDER}:*")
            options.setdefault("data_host", HOST_PLACEHOLDER)
            for n, kp in pairs.items():
                own = {**options, "keypair": options.get("keypair", keypair_to_string(kp))}
                instance_env[n][ENV_CONNECTOR_OPTIONS] = json.dumps(own)
            options.setdefault("keypair", keypair_to_string(worker))
        worker_env[ENV_CONNECTOR_OPTIONS] = json.dumps(options)
    _ec_secrets(config, pairs, instance_env)
    publishers = {kp.name: kp.public.decode() for kp in pairs.values()}
    router_env = {"router": keypair_to_string(router), "worker": worker.public.decode(),
                  "publishers": json.dumps(publishers)}
    return ClusterSecrets(worker_env, router_env, made, instance_env)


def _ec_secrets(config: ClusterConfig, pairs: dict, instance_env: dict[str, dict[str, str]]) -> None:
    """The EC connector's keys per instance (its own pair; every instance's public key may fetch),
    and no KV connector options for encode instances (they run none)."""
    from pdcluster.security.keys import keypair_to_string

    for name in instance_env:
        if name.startswith("encode-"):
            instance_env[name][ENV_CONNECTOR_OPTIONS] = ""  # empty: serve-worker reads nothing
    if config.ec_connector is None:
        return
    options = dict(config.ec_connector.options)
    if config.ec_connector.name == "p2p_ec":
        options.setdefault("allowed_keys", {kp.name: kp.public.decode() for kp in pairs.values()})
    for name, kp in pairs.items():
        own = {**options, "keypair": options.get("keypair", keypair_to_string(kp))} \
            if config.ec_connector.name == "p2p_ec" else options
        instance_env[name][ENV_EC_OPTIONS] = json.dumps(own)


def bind_host_into(env: dict[str, str], host: str) -> dict[str, str]:
    """env with HOST_PLACEHOLDER replaced by the worker's bind address (a JSON-safe IP/name)."""
    return {k: v.replace(HOST_PLACEHOLDER, host) for k, v in env.items()}


def write_router_keys(env: dict[str, str], root_dir: str | None = None) -> str:
    """A private key folder (0700, secret 0600) on the router's node in the layout RouterConfig's
    key_dir expects: the router's pair and the allowed KV-event publishers' public keys. Written
    into root_dir (an empty private folder: private_dirs.make_private_folder, which ties it to
    the router's process) or a new temporary one."""
    from pdcluster.security.keys import _cert_text, _write_new, keypair_from_string

    root = pathlib.Path(root_dir or tempfile.mkdtemp(prefix="pdcluster-router-keys-"))
    (root / "secret").mkdir(mode=0o700)
    (root / "public").mkdir(mode=0o700)
    router = keypair_from_string(env["router"], "router")
    _write_new(root / "secret" / "router.key_secret", _cert_text(router, True), 0o600, False)
    publics = {name: env[name].partition(",")[0] for name in ("router", "worker")}
    publics.update(json.loads(env.get("publishers") or "{}"))  # per-instance worker keys
    for name, key in publics.items():
        pub = keypair_from_string(key, name)
        _write_new(root / "public" / f"{name}.key", _cert_text(pub, False), 0o600, False)
    return str(root)
