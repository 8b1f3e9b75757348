"""Who may call what on the kvstore master under mutual TLS (issue 16, item 2).

Roles come from the caller's verified certificate (pdcluster/security/pki.py): only storage
nodes mount, heartbeat and unmount, and only under their own node id (the certificate's name);
a live node's address cannot be moved by a new mount; only workers put, get and remove
objects (the router may ask whether keys exist); Stats is open to any CA-signed peer. Plaintext
masters (no client CA) keep the old behaviour: nothing here applies.
"""

from __future__ import annotations

from typing import Any

from pdcluster.security.grpc_authz import RolePolicy, peer_identity

_SERVICE = "/pdcluster.v1.KVStoreMaster/"
NODE_METHODS = ("MountSegment", "UnmountSegment", "Heartbeat")
WORKER_METHODS = ("PutStart", "PutEnd", "PutRevoke", "ReserveArena", "CommitArena", "ReleaseArena", "GetReplicas",
                  "OpenLookup", "Remove")  # OpenLookup: GetReplicas over the same-host socket (lookup_socket.py)
LOOKUP_METHODS = ("Exists", "BatchExists")


def kvstore_policy() -> RolePolicy:
    allowed: dict[str, set[str]] = {}
    allowed.update({_SERVICE + m: {"kvstore-node"} for m in NODE_METHODS})
    allowed.update({_SERVICE + m: {"worker"} for m in WORKER_METHODS})
    allowed.update({_SERVICE + m: {"worker", "router"} for m in LOOKUP_METHODS})
    return RolePolicy(allowed)


def node_id_refusal(context: Any, node_id: str) -> str | None:
    """Why a node request for `node_id` is refused (its certificate names another node), or None.
    A caller without an identity (plaintext master) is not checked here."""
    who = peer_identity(context)
    if who is None or who == ("kvstore-node", node_id):
        return None
    return f"certificate {who[0]}/{who[1]} may not act for node {node_id!r}"
