"""Client-facing ports (issue 16, item 3): `pdcluster serve` with --api-key and TLS (vLLM's
--ssl-certfile/--ssl-keyfile) answers the official `openai` client over HTTPS and the pdcluster
gRPC client over TLS only with the key; a non-loopback --host without TLS or a key refuses to
start unless --insecure is given. Real processes on free ports, stopped by pid."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import grpc
import openai
import pytest
from security.deploy_probes import wait_refusals
from serve_procs import start_serve, stop_serve

from pdcluster import SamplingParams
from pdcluster.client import Client, ClientError
from pdcluster.router.auth import check_exposure, is_loopback
from pdcluster.worker.tls import TLSConfig

KEY = "test-key-0123456789"
PY = sys.executable


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    from pdcluster.models.demo import ensure_demo_model

    return str(ensure_demo_model(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("certs")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=server")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "san.ext")
    return d


def test_exposure_rule() -> None:
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.5"):
        assert is_loopback(host)
        check_exposure(host, tls=False, api_key=False, insecure=False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        assert not is_loopback(host)
        with pytest.raises(ValueError, match="--insecure"):
            check_exposure(host, tls=False, api_key=False, insecure=False)
        check_exposure(host, tls=True, api_key=False, insecure=False)
        check_exposure(host, tls=False, api_key=True, insecure=False)
        check_exposure(host, tls=False, api_key=False, insecure=True)


@pytest.mark.parametrize("command", [["serve"], ["router", "--workers", "127.0.0.1:9"]], ids=["serve", "router"])
def test_non_loopback_without_tls_or_key_refuses_to_start(command) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PDCLUSTER_API_KEY"}
    r = subprocess.run([PY, "-m", "pdcluster.cluster.cli", *command, "--host", "0.0.0.0", "--grpc-port", "0",
                        "--http-port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert "0.0.0.0" in r.stderr and "--insecure" in r.stderr and "--api-key" in r.stderr
    assert "PDCLUSTER_READY" not in r.stdout


def test_non_loopback_router_with_insecure_starts(demo_model) -> None:
    proc = subprocess.Popen([PY, "-m", "pdcluster.cluster.cli", "router", "--workers", "127.0.0.1:9", "--model",
                             demo_model, "--host", "0.0.0.0", "--insecure", "--grpc-port", "0", "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        assert any(line.startswith("PDCLUSTER_READY ") for line in proc.stdout)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def secured(demo_model, certs):
    proc, ready = start_serve(["--model", demo_model, "--worker-args", "--max-model-len 256", "--api-key", KEY,
                               "--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key")])
    try:
        yield ready, certs
    finally:
        stop_serve(proc)


def test_openai_client_over_https_with_the_key(secured) -> None:
    ready, certs = secured
    assert ready["http"].startswith("https://")
    base = ready["http"] + "/v1"

    def oa(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60,
                             http_client=openai.DefaultHttpxClient(verify=str(certs / "ca.pem")))

    model = oa(KEY).models.list().data[0].id
    r = oa(KEY).completions.create(model=model, prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        oa("not-the-key").completions.create(model=model, prompt=[5, 6, 7], max_tokens=2)
    with pytest.raises(openai.APIConnectionError):  # plaintext HTTP to the TLS port
        openai.OpenAI(base_url=base.replace("https://", "http://"), api_key=KEY, max_retries=0,
                      timeout=10).models.list()


def test_grpc_client_over_tls_with_the_key(secured) -> None:
    ready, certs = secured
    tls = TLSConfig(ca=str(certs / "ca.pem"))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with Client(ready["grpc"], timeout=60, tls=tls, api_key=KEY) as c:
        assert len(c.generate([5, 6, 7], params).token_ids) == 2
    with Client(ready["grpc"], timeout=60, tls=tls, api_key="nope") as c, pytest.raises(ClientError) as e:
        c.generate([5, 6, 7], params)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(ready["grpc"], timeout=10, api_key=KEY) as c, pytest.raises(ClientError) as e:  # plaintext
        c.generate([5, 6, 7], params)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    # The refused plaintext handshake is counted and named on the router's /metrics (tls_audit.py).
    import ssl

    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    # Named 127.0.0.1, or "unseen" when the client reset the connection before the audit read.
    # gRPC's channel may try the handshake again before the client closes it (its reconnect
    # backoff, ~1 s, against however long the close takes here): at least one, each one named.
    refused, named, unseen = wait_refusals(ready["http"] + "/metrics", "router", 1, ctx)
    assert refused >= 1 and named + unseen == refused
    # `pdcluster generate --router` takes the key too (flag, or $PDCLUSTER_API_KEY).
    argv = [PY, "-m", "pdcluster.cluster.cli", "generate", "--router", ready["grpc"], "--max-tokens", "2",
            "--tls-ca", str(certs / "ca.pem")]
    r = subprocess.run([*argv, "--api-key", "wrong"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**os.environ, "PDCLUSTER_API_KEY": KEY})
    assert r.returncode == 0, r.stderr
