"""A CA rotation on --key-dir reaches a running `pdcluster up` (real Ray). Detached, through
`up --reload-keys`: after `keys rotate-ca` the worker serves a new-CA certificate and the router
presents one, after `keys revoke-ca` the worker refuses an old-CA router certificate; requests
through the router keep working all along (a client thread sends them during both pushes).
Foreground: `up` pushes by itself when the CA files change and on SIGHUP, and a SIGKILLed worker
actor's TLS folder is gone at once, its restarted incarnation given a current identity."""

from __future__ import annotations

import json
import pathlib
import shutil
import threading

import grpc
import pytest
import ray_up
from cryptography import x509

from pdcluster.cluster.ray_tls import WORKER_SERVER_NAME
from pdcluster.worker.tls import TLSConfig, channel_credentials

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def cluster_env(tmp_path):
    yield from ray_up.cluster_env(tmp_path, "tlsrot")


def _issuer(path: str) -> str:
    return x509.load_pem_x509_certificate(pathlib.Path(path).read_bytes()).issuer.rfc4514_string()


def _health(addr: str, cfg: TLSConfig) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    opts = [("grpc.ssl_target_name_override", WORKER_SERVER_NAME), ("grpc.use_local_subchannel_pool", 1)]
    with grpc.secure_channel(addr, channel_credentials(cfg), options=opts) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_reload_keys_reaches_running_actors(cluster_env, tmp_path) -> None:
    from pdcluster import SamplingParams
    from pdcluster.client import Client

    env, ns = cluster_env
    keys = tmp_path / "keys"
    assert ray_up.cli(env, "keys", "init", str(keys)).returncode == 0
    old_router = tmp_path / "old-router"  # an old-CA router certificate, to be refused after revoke-ca
    shutil.copytree(keys / "tls" / "router", old_router)
    up = ray_up.cli(env, "up", "--detach", "--workers", "1", "--grpc-port", "0", "--http-port", "-1", "--namespace", ns,
                    "--num-cpus", "2", "--no-dashboard", "--key-dir", str(keys), timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    ready = json.loads(next(x for x in up.stdout.splitlines() if x.startswith("PDCLUSTER_READY ")).split(" ", 1)[1])
    (inst,) = ready["instances"].values()
    argv = [a.decode() for a in pathlib.Path(f"/proc/{inst['child_pid']}/cmdline").read_bytes().split(b"\0") if a]
    cert = argv[argv.index("--tls-cert") + 1]
    first_issuer = _issuer(cert)

    errors: list[BaseException] = []
    done = threading.Event()
    served = [0]

    def load() -> None:  # requests through the router while the keys change under it
        with Client(ready["grpc"], timeout=120) as client:
            while not done.is_set():
                try:
                    out = client.generate(list(range(5, 20)), SamplingParams(temperature=0, max_tokens=2,
                                                                             ignore_eos=True))
                    assert len(out.token_ids) == 2
                    served[0] += 1
                except BaseException as e:
                    errors.append(e)
                    return

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        for step in ("rotate-ca", "revoke-ca"):
            assert ray_up.cli(env, "keys", step, str(keys)).returncode == 0
            out = ray_up.cli(env, "up", "--reload-keys", "--namespace", ns, timeout=120)
            assert out.returncode == 0 and "pushed to 2 actor(s)" in out.stdout, out.stdout + out.stderr
            assert _issuer(cert) != first_issuer
            before = served[0]
            for _ in range(600):  # bounds a hang only: requests flow after the push
                if served[0] > before + 2 or errors:
                    break
                threading.Event().wait(0.05)
    finally:
        done.set()
        thread.join(120)
    assert not errors, errors
    assert served[0] > 0
    with pytest.raises(grpc.RpcError) as e:  # the worker dropped the old CA
        _health(inst["address"], TLSConfig(ca=str(keys / "tls" / "ca.pem"), cert=str(old_router / "cert.pem"),
                                           key=str(old_router / "key.pem")))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    down = ray_up.cli(env, "down", "--namespace", ns, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr


class _Foreground:
    """A foreground `pdcluster up` whose stderr lines are collected by a thread."""

    def __init__(self, env: dict, *argv: str) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "pdcluster.cluster.cli", "up", *argv], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.ready: dict | None = None
        threading.Thread(target=self._pump, args=(self.proc.stderr,), daemon=True).start()
        for line in self.proc.stdout:
            if line.startswith("PDCLUSTER_READY "):
                self.ready = json.loads(line.split(" ", 1)[1])
                break
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def wait_line(self, text: str, count: int = 1, timeout_s: float = 120.0) -> None:
        for _ in range(int(timeout_s / 0.05)):  # bounds a hang only
            if sum(text in x for x in self.lines) >= count:
                return
            assert self.proc.poll() is None, "".join(self.lines)
            threading.Event().wait(0.05)
        raise AssertionError(f"no {text!r} in:\n" + "".join(self.lines))

    def stop(self) -> int:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # by pid: the process this test started
            try:
                return self.proc.wait(180)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def test_foreground_up_follows_the_ca_and_refreshes_a_restarted_worker(cluster_env, tmp_path) -> None:
    import os
    import signal

    from pdcluster import SamplingParams
    from pdcluster.client import Client

    env, ns = cluster_env
    keys = tmp_path / "keys"
    assert ray_up.cli(env, "keys", "init", str(keys)).returncode == 0
    up = _Foreground(env, "--workers", "1", "--grpc-port", "0", "--http-port", "-1", "--namespace", ns,
                     "--num-cpus", "2", "--no-dashboard", "--key-dir", str(keys))
    try:
        assert up.ready is not None, "".join(up.lines)
        (inst,) = up.ready["instances"].values()
        argv = [a.decode() for a in pathlib.Path(f"/proc/{inst['child_pid']}/cmdline").read_bytes().split(b"\0") if a]
        folder = os.path.dirname(argv[argv.index("--tls-cert") + 1])
        assert ray_up.cli(env, "keys", "rotate-ca", str(keys)).returncode == 0
        up.wait_line("TLS rotation pushed to 2 actor(s)")  # the CA files changed: pushed by itself
        assert ray_up.cli(env, "keys", "revoke-ca", str(keys)).returncode == 0
        os.kill(up.proc.pid, signal.SIGHUP)  # a reload on request too (the files changed as well)
        up.wait_line("TLS rotation pushed to 2 actor(s)", count=2)
        assert up.proc.poll() is None  # SIGHUP reloads, it does not stop `up`
        # A SIGKILLed worker actor: its TLS folder goes at once; Ray restarts it with its start-up
        # (old-CA) identity, which the foreground `up` replaces.
        os.kill(inst["actor_pid"], signal.SIGKILL)
        for _ in range(600):  # bounds a hang only
            if not os.path.exists(folder):
                break
            threading.Event().wait(0.05)
        assert not os.path.exists(folder)
        up.wait_line("given current identities", timeout_s=300)
        out = None
        with Client(up.ready["grpc"], timeout=120) as client:
            for _ in range(600):  # until the router re-admitted the restarted worker
                try:
                    out = client.generate(list(range(5, 20)), SamplingParams(temperature=0, max_tokens=2,
                                                                             ignore_eos=True))
                    break
                except Exception:
                    threading.Event().wait(0.2)
            assert out is not None and len(out.token_ids) == 2
    finally:
        code = up.stop()
    assert code == 0, "".join(up.lines)
