"""gRPC TLS between client, node and master (in-process servers, real sockets on 127.0.0.1)."""

from __future__ import annotations

import datetime
import ipaddress
import secrets

import pytest

from pdcluster.kvstore import KVStoreClient, KVStoreError, MasterConfig, MasterServer, Status, StorageNode
from pdcluster.kvstore.rpc import server_credentials


def self_signed(tmp_path) -> tuple[str, str]:
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def test_tls_master(tmp_path) -> None:
    cert, key = self_signed(tmp_path)
    secret = secrets.token_bytes(32)
    master = MasterServer(MasterConfig(), secret, credentials=server_credentials(cert, key)).start()
    node = None
    try:
        node = StorageNode(master.address, secret, [1 << 20], node_id="tls-node", tls_ca=cert).start()
        with KVStoreClient(master.address, tls_ca=cert) as c:
            assert c.put("k", b"secret bytes") == Status.OK
            assert c.get_bytes("k") == b"secret bytes"
        with KVStoreClient(master.address, rpc_timeout_s=2) as plain, pytest.raises(KVStoreError):
            plain.exists("k")  # plaintext gRPC to a TLS master fails cleanly
    finally:
        if node is not None:
            node.stop()
        master.stop()
