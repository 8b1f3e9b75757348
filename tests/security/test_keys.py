"""Key files: modes from creation, refusal to overwrite, loading, allow-lists, string form."""

from __future__ import annotations

import os
import stat

import pytest
import zmq
import zmq.auth

from pdcluster.security import keys as K
from pdcluster.security.keys import (
    KeyMaterialError,
    KeyPair,
    init_keys,
    keypair_from_env,
    keypair_from_string,
    keypair_to_string,
    load_allowed_public_keys,
    load_keypair,
)


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_init_keys_layout_and_modes(tmp_path, monkeypatch):
    chmod_calls = []
    real_chmod = os.chmod
    monkeypatch.setattr(os, "chmod", lambda p, m, *a, **k: (chmod_calls.append(str(p)), real_chmod(p, m, *a, **k)))
    old_umask = os.umask(0)  # a permissive umask must not make secrets readable
    try:
        ks = init_keys(tmp_path / "keys", names=("router", "worker", "client"))
    finally:
        os.umask(old_umask)
    root = tmp_path / "keys"
    assert set(ks.keypairs) == {"router", "worker", "client"}
    assert mode(root / "secret") == 0o700
    for name in ks.keypairs:
        secret = root / "secret" / f"{name}.key_secret"
        assert mode(secret) == 0o600
        assert mode(root / "public" / f"{name}.key") == 0o644
        assert "secret-key" not in (root / "public" / f"{name}.key").read_text()
    # Created with their mode, never chmod'ed afterwards (no window where they are readable).
    assert not [c for c in chmod_calls if c.endswith(".key_secret")]


def test_refuses_to_overwrite_unless_asked(tmp_path):
    first = init_keys(tmp_path, names=("router", "client"))
    with pytest.raises(FileExistsError):
        init_keys(tmp_path, names=("client", "newnode"))
    assert not (tmp_path / "public" / "newnode.key").exists()  # nothing half-written
    assert load_keypair(tmp_path, "client") == first.keypairs["client"]
    second = init_keys(tmp_path, names=("client",), overwrite=True)
    assert second.keypairs["client"].public != first.keypairs["client"].public
    assert load_keypair(tmp_path, "client") == second.keypairs["client"]
    assert mode(tmp_path / "secret" / "client.key_secret") == 0o600
    assert not list(tmp_path.rglob("*.tmp*"))


def test_load_keypair_roundtrip_and_zmq_compatible(tmp_path):
    ks = init_keys(tmp_path, names=("router",))
    kp = load_keypair(tmp_path, "router")
    assert kp == ks.keypairs["router"] and kp.has_secret
    assert zmq.curve_public(kp.secret) == kp.public
    pub, sec = zmq.auth.load_certificate(str(tmp_path / "secret" / "router.key_secret"))
    assert (pub, sec) == (kp.public, kp.secret)
    assert kp.secret.decode() not in repr(kp)  # secrets never reach logs through repr


def test_load_keypair_refuses_readable_secret(tmp_path):
    init_keys(tmp_path, names=("router",))
    secret = tmp_path / "secret" / "router.key_secret"
    os.chmod(secret, 0o644)
    with pytest.raises(KeyMaterialError, match="readable by others"):
        load_keypair(tmp_path, "router")
    assert load_keypair(tmp_path, "router", check_permissions=False).has_secret


def test_load_keypair_rejects_mismatched_or_missing(tmp_path):
    init_keys(tmp_path, names=("a", "b"))
    a = (tmp_path / "secret" / "a.key_secret").read_text()
    b = (tmp_path / "secret" / "b.key_secret").read_text()
    # a's public key with b's secret key
    b_secret_line = [ln for ln in b.splitlines() if "secret-key" in ln][0]
    forged = "\n".join(b_secret_line if "secret-key" in ln else ln for ln in a.splitlines())
    (tmp_path / "secret" / "a.key_secret").write_text(forged)
    with pytest.raises(KeyMaterialError, match="does not match"):
        load_keypair(tmp_path, "a")
    with pytest.raises(KeyMaterialError, match="no secret key file"):
        load_keypair(tmp_path, "c")


def test_allowed_public_keys(tmp_path):
    ks = init_keys(tmp_path, names=("router", "worker", "client"))
    allowed = load_allowed_public_keys(tmp_path)
    assert allowed == ks.allowed_public_keys()
    assert load_allowed_public_keys(tmp_path / "public") == allowed
    (tmp_path / "public" / "junk.key").write_text('curve\n    public-key = "nope"\n')
    with pytest.raises(KeyMaterialError):
        load_allowed_public_keys(tmp_path)


@pytest.mark.parametrize("name", ["../evil", "a/b", ".hidden", "", "x" * 65, "sp ace"])
def test_bad_names_rejected(tmp_path, name):
    with pytest.raises(KeyMaterialError):
        init_keys(tmp_path, names=(name,))


def test_string_form_roundtrip(monkeypatch):
    kp = K.generate_keypair("worker")
    text = keypair_to_string(kp)
    assert keypair_from_string(text, "worker") == kp
    only_public = keypair_from_string(keypair_to_string(KeyPair("w", kp.public)))
    assert only_public.public == kp.public and not only_public.has_secret
    other = K.generate_keypair("x")
    with pytest.raises(KeyMaterialError):
        keypair_from_string(f"{kp.public.decode()},{other.secret.decode()}")
    with pytest.raises(KeyMaterialError):
        keypair_from_string("not-a-key")
    monkeypatch.setenv("PDC_TEST_KEY", text)
    assert keypair_from_env("PDC_TEST_KEY", "worker") == kp
    monkeypatch.delenv("PDC_TEST_KEY")
    with pytest.raises(KeyMaterialError):
        keypair_from_env("PDC_TEST_KEY")


def test_raw_public_key_normalized():
    from zmq.utils import z85

    kp = K.generate_keypair("a")
    assert K.normalize_public_key(z85.decode(kp.public)) == kp.public
    assert K.normalize_public_key(kp.public.decode()) == kp.public
