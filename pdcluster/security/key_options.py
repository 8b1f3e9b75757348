"""CURVE key material from a connector's plain-data options, one way for every connector that
runs a CURVE endpoint (the P2P KV connector, the p2p_ec encoder-cache connector, plugins):

    keypair: "PUBLIC,SECRET" | KeyPair     or   keys_dir + key_name   (`pdcluster keys init DIR`)
    allowed_keys: {name: public key} | [public keys]   or   keys_dir (its public/ folder)

Errors name the connector and the options field the operator sets, since these options come from
deployment config, never request data.
"""

from __future__ import annotations

from typing import Any

from pdcluster.security.keys import (
    KeyPair,
    keypair_from_string,
    load_allowed_public_keys,
    load_keypair,
    normalize_public_key,
)


def keypair_option(o: dict[str, Any], connector: str, field: str, name: str) -> KeyPair:
    """This endpoint's own pair (with its secret) from options `o` of `connector` (set in `field`);
    `name` labels a pair given inline."""
    kp = o.get("keypair")
    if isinstance(kp, KeyPair):
        pair = kp
    elif isinstance(kp, str):
        pair = keypair_from_string(kp, name)
    elif o.get("keys_dir") and o.get("key_name"):
        pair = load_keypair(o["keys_dir"], o["key_name"])
    else:
        raise ValueError(f"the {connector} connector needs CURVE keys: set {field} 'keypair' "
                         "('PUBLIC,SECRET') or 'keys_dir' and 'key_name' (pdcluster keys init DIR)")
    if not pair.has_secret:
        raise ValueError(f"{connector} keypair has no secret key")
    return pair


def allowed_keys_option(o: dict[str, Any], connector: str) -> dict[str, bytes]:
    """The public keys this endpoint talks to (its allow-list), by name."""
    allowed = o.get("allowed_keys")
    if allowed is None and o.get("keys_dir"):
        return load_allowed_public_keys(o["keys_dir"])
    if isinstance(allowed, dict):
        return {str(k): normalize_public_key(v) for k, v in allowed.items()}
    if isinstance(allowed, (list, tuple)):
        return {f"key{i}": normalize_public_key(v) for i, v in enumerate(allowed)}
    raise ValueError(f"the {connector} connector needs 'allowed_keys' (the cluster's public keys) or 'keys_dir'")


__all__ = ["allowed_keys_option", "keypair_option"]
