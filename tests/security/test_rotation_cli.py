"""`pdcluster keys rotate/revoke/rotate-ca/reissue/revoke-ca`: the files each step leaves."""

from __future__ import annotations

import pathlib

from cryptography import x509

from pdcluster.cluster.cli import main
from pdcluster.security.keys import load_allowed_public_keys, load_keypair


def _cas(d: pathlib.Path) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates((d / "tls" / "ca.pem").read_bytes())


def test_keys_rotation_commands(tmp_path: pathlib.Path) -> None:
    d = tmp_path / "keys"
    assert main(["keys", "init", str(d)]) == 0
    old = load_keypair(d, "worker").public
    assert main(["keys", "rotate", str(d), "worker"]) == 0
    both = load_allowed_public_keys(d)
    assert both["worker"] == old and both["worker.next"] != old
    assert main(["keys", "rotate", str(d), "worker"]) == 2  # one rotation at a time
    assert main(["keys", "revoke", str(d), "worker"]) == 0
    after = load_allowed_public_keys(d)
    assert "worker.next" not in after and after["worker"] == both["worker.next"]
    assert load_keypair(d, "worker").public == after["worker"]
    assert main(["keys", "revoke", str(d), "worker"]) == 2  # nothing under way

    (old_ca,) = _cas(d)
    old_cert = (d / "tls" / "worker" / "cert.pem").read_bytes()
    assert main(["keys", "rotate-ca", str(d)]) == 0
    new_ca, second = _cas(d)
    assert second == old_ca and new_ca != old_ca
    cert = x509.load_pem_x509_certificate((d / "tls" / "worker" / "cert.pem").read_bytes())
    assert cert.issuer == new_ca.subject and (d / "tls" / "worker" / "cert.pem").read_bytes() != old_cert
    assert main(["keys", "rotate-ca", str(d)]) == 2  # finish the first rotation first
    assert main(["keys", "reissue", str(d), "router"]) == 0
    assert main(["keys", "revoke-ca", str(d)]) == 0
    assert _cas(d) == [new_ca]
