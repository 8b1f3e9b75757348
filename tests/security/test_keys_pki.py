"""`pdcluster keys init` also makes the cluster CA and per-instance certificates (issue 16,
item 1); `pdcluster keys issue` adds one more instance. Private files 0600 in 0700 folders."""

from __future__ import annotations

import stat
import subprocess
import sys

from cryptography import x509

from pdcluster.security.pki import identity_of_cert


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "keys", *args], capture_output=True,
                          text=True)


def test_keys_init_makes_a_ca_and_instance_certificates(tmp_path) -> None:
    d = tmp_path / "keys"
    assert _cli("init", str(d)).returncode == 0
    tls = d / "tls"
    assert stat.S_IMODE(tls.stat().st_mode) == 0o700 and stat.S_IMODE((tls / "ca.key").stat().st_mode) == 0o600
    for role in ("router", "worker", "kvstore-master", "kvstore-node", "client"):
        folder = tls / role
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE((folder / "key.pem").stat().st_mode) == 0o600
        cert = x509.load_pem_x509_certificate((folder / "cert.pem").read_bytes())
        assert identity_of_cert(cert) == (role, role)
    done = _cli("issue", str(d), "worker", "prefill-0")
    assert done.returncode == 0 and "spiffe://pdcluster/worker/prefill-0" in done.stdout
    cert = x509.load_pem_x509_certificate((tls / "prefill-0" / "cert.pem").read_bytes())
    assert identity_of_cert(cert) == ("worker", "prefill-0")
    assert _cli("issue", str(d), "worker", "prefill-0").returncode == 2  # never overwrites
    assert _cli("issue", str(d), "admin", "x").returncode == 2  # unknown role
