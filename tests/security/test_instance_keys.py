"""Per-instance CURVE pairs with a user's key folder (issue 16 item 5): `serve --key-dir` and
`up --key-dir` give each worker instance its own pair (made in the folder when missing, kept
across runs), so servers tell the workers apart; the shared "worker" pair is only a fallback."""

from __future__ import annotations

import json

import pytest

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.ray_secrets import ENV_CONNECTOR_OPTIONS, ENV_WORKER_KEY, cluster_secrets
from pdcluster.security.keys import (
    KeyMaterialError,
    ensure_instance_keys,
    init_keys,
    load_allowed_public_keys,
    load_keypair,
)


def test_ensure_makes_then_keeps(tmp_path) -> None:
    init_keys(tmp_path / "k")
    first = ensure_instance_keys(tmp_path / "k", ["prefill-0", "decode-0"])
    assert first["prefill-0"].public != first["decode-0"].public
    assert {"prefill-0", "decode-0", "worker"} <= set(load_allowed_public_keys(tmp_path / "k"))
    again = ensure_instance_keys(tmp_path / "k", ["prefill-0", "decode-0"])
    assert again == first  # a restart keeps the identity


def test_public_key_without_secret_is_not_replaced(tmp_path) -> None:
    init_keys(tmp_path / "k", ["router", "decode-0"])
    (tmp_path / "k" / "secret" / "decode-0.key_secret").unlink()
    with pytest.raises(KeyMaterialError):
        ensure_instance_keys(tmp_path / "k", ["decode-0"])


def test_up_with_key_dir_hands_each_instance_its_pair(tmp_path) -> None:
    init_keys(tmp_path / "k")
    c = ClusterConfig.from_dict({"pools": {"prefill": {}, "decode": {"instances": 2}}, "key_dir": str(tmp_path / "k"),
                                 "connector": {"name": "p2p"}})
    found = cluster_secrets(c)
    assert found.key_dir is None  # nothing made outside the user's folder
    keys = {n: found.for_instance(n)[ENV_WORKER_KEY] for n in ("prefill-0", "decode-0", "decode-1")}
    assert len(set(keys.values())) == 3
    for n, pair in keys.items():
        kp = load_keypair(tmp_path / "k", n)
        assert pair.split(",")[0] == kp.public.decode()
        opts = json.loads(found.for_instance(n)[ENV_CONNECTOR_OPTIONS])
        assert opts["keypair"] == pair and sorted(opts["allowed_keys"]) == sorted(keys)
    # The router allows every instance as a KV-event publisher.
    assert sorted(json.loads(found.router_env["publishers"])) == sorted(keys)
