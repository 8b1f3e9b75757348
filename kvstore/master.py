"""KV store master process: gRPC API + periodic maintenance + /metrics.

    python -m pdcluster.kvstore.master --port 50070 --data-dir ./kvstore-master --secret-file kv.secret

Prints one JSON line `{"event": "kvstore_master_ready", "address": ..., "metrics_port": ...}` on
stdout once it serves (launchers and tests wait for it), then runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from concurrent import futures

import grpc

from pdcluster._proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.grpc_decode import add_servicer
from pdcluster.grpc_limits import common_server_options
from pdcluster.security.grpc_authz import RoleInterceptor, RolePolicy
from pdcluster.security.tls_audit import HandshakeAudit

from .authz import kvstore_policy
from .core import MasterCore
from .entities import MasterConfig
from .failover import restrict_feed
from .lookup_socket import LookupSocket
from .metrics import serve_metrics
from .oplog import FSYNC_POLICIES
from .rpc import add_tls_server_args, make_channel, server_credentials
from .secret import load_secret
from .servicer import MasterServicer
from .standby import HAController, HAOptions, build_ha
from .takeover import TAKEOVER_MODES

log = logging.getLogger(__name__)


class MasterServer:
    def __init__(self, config: MasterConfig, secret: bytes, *, host: str = "127.0.0.1", port: int = 0,
                 data_dir: str | None = None, fsync: str = "interval", snapshot_interval_s: float = 300.0,
                 metrics_port: int | None = None, credentials: grpc.ServerCredentials | None = None,
                 tick_s: float = 0.2, max_workers: int = 8, role_policy: RolePolicy | None = None,
                 ha: HAOptions | None = None, lookup_socket: bool = True) -> None:
        # lookup_socket: serve GetReplicas to same-host clients on a Unix socket too (kvstore/lookup_socket.py)
        # ha: a standby / peer master (kvstore/standby.py); None: a lone master, as before
        # role_policy: with mutual TLS, which certificate roles may call what (kvstore/authz.py)
        self.role_policy = role_policy
        self.tls_audit: HandshakeAudit | None = None  # set before start(): counts refused handshakes
        self.core = MasterCore(config, secret, data_dir, fsync=fsync, snapshot_interval_s=snapshot_interval_s)
        self.servicer = MasterServicer(self.core)
        self._host, self._port = host, port
        self._metrics_port = metrics_port
        self._creds = credentials
        self._tick_s = tick_s
        self._max_workers = max_workers
        self._lookup_socket = lookup_socket
        self._stop = threading.Event()
        self._grpc: grpc.Server | None = None
        self._httpd = None
        self._ticker: threading.Thread | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self.ha: HAController | None = build_ha(self.core, ha, data_dir) if ha is not None else None
        self.role = "primary"
        if self.ha is not None:
            self.servicer = self.ha.servicer

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    def start(self) -> MasterServer:
        if self.ha is None:
            self.core.recover()  # before serving: no request may see a half-recovered store
        interceptors = [RoleInterceptor(self.role_policy)] if self.role_policy is not None else []
        if self.tls_audit is not None:  # refused TLS handshakes, counted and named
            interceptors.insert(0, self.tls_audit.sync_interceptor())
        if self.ha is not None:
            interceptors.append(self.ha.gate)  # after the role check: standbys refuse, epochs stamped
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self._max_workers), interceptors=interceptors,
                             options=common_server_options())
        add_servicer(pb_grpc.add_KVStoreMasterServicer_to_server, self.servicer, server)
        bind = f"{self._host}:{self._port}"
        self.port = server.add_secure_port(bind, self._creds) if self._creds else server.add_insecure_port(bind)
        if not self.port:
            raise OSError(f"cannot bind gRPC on {bind}")
        if self.tls_audit is not None:
            self.tls_audit.start(self.port)
        if self.ha is not None:
            self.role = self.ha.decide(self.address)  # a standby does not recover: its state comes from the primary
        if self._lookup_socket:
            ha = self.ha
            gate = (lambda: (ha.role.primary, ha.role.epoch)) if ha is not None else (lambda: (True, 0))
            self.servicer.lookup = LookupSocket(self.servicer.get_replicas, gate, max_batch=self.core.config.max_batch,
                                                commit_arena=self.servicer.commit_arena,
                                                replication=ha.hub if ha is not None else None)
        server.start()
        if self.ha is not None:
            self.ha.start()
        self._grpc = server
        if self._metrics_port is not None:
            self._httpd, self.metrics_port = serve_metrics(self.servicer.stats, self._host, self._metrics_port,
                                                           *([self.tls_audit] if self.tls_audit is not None else []))
        self._ticker = threading.Thread(target=self._tick_loop, name="kvstore-master-tick", daemon=True)
        self._ticker.start()
        return self

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._tick_s):
            if self.ha is not None and not self.ha.role.primary:
                continue  # a standby's state changes only by its primary's records
            try:
                self.core.tick()
            except Exception:  # maintenance must keep running; the error is logged
                log.exception("kvstore master maintenance failed")

    def stop(self, grace_s: float = 1.0) -> None:
        self._stop.set()
        if self.ha is not None:
            self.ha.stop()
        if self._grpc is not None:
            self._grpc.stop(grace_s).wait()
        if self.servicer.lookup is not None:
            self.servicer.lookup.close()
        if self.tls_audit is not None:
            self.tls_audit.stop()
        if self._ticker is not None:
            self._ticker.join()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        self.core.close()

    def wait(self) -> None:
        self._stop.wait()


def add_master_args(p: argparse.ArgumentParser) -> None:
    d = MasterConfig()
    p.add_argument("--host", default="127.0.0.1", help="bind address (gRPC and /metrics); default loopback only")
    p.add_argument("--port", type=int, default=50070, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port (0: any)")
    p.add_argument("--data-dir", default=None, help="op log + snapshot directory (omit: no persistence)")
    p.add_argument("--fsync", choices=FSYNC_POLICIES, default="interval")
    p.add_argument("--snapshot-interval-s", type=float, default=300.0)
    p.add_argument("--secret-file", default=None,
                   help="data-plane secret shared with the nodes (hex, mode 0600; created if missing); "
                        "else $PDCLUSTER_KVSTORE_SECRET")
    p.add_argument("--lease-ttl-s", type=float, default=d.lease_ttl_s)
    p.add_argument("--put-timeout-s", type=float, default=d.put_timeout_s)
    p.add_argument("--grace-s", type=float, default=d.grace_s)
    p.add_argument("--node-timeout-s", type=float, default=d.node_timeout_s)
    p.add_argument("--high-watermark", type=float, default=d.high_watermark)
    p.add_argument("--low-watermark", type=float, default=d.low_watermark)
    p.add_argument("--arena-max-fraction", type=float, default=d.arena_max_fraction,
                   help="largest write arena, as a fraction of a segment")
    add_tls_server_args(p)
    p.add_argument("--lookup-socket", action=argparse.BooleanOptionalAction, default=True,
                   help="also answer same-host clients' lookups on a Unix socket in a private directory, "
                        "opened through the gRPC API (kvstore/lookup_socket.py)")
    p.add_argument("--standby-of", default=None, metavar="ADDR",
                   help="start as the standby of the primary master at ADDR: follow its op log, take over when it dies")
    p.add_argument("--peer", default=None, metavar="ADDR",
                   help="the other master of a pair: start as primary unless ADDR already is one (then follow it)")
    p.add_argument("--failover-timeout-s", type=float, default=3.0,
                   help="a standby takes over after its primary was unreachable this long (and shown dead: --takeover)")
    p.add_argument("--takeover", choices=TAKEOVER_MODES, default="on-refusal",
                   help="on-refusal: promote only when the primary's port refuses connections (silence may be a "
                        "partition; kill -USR1 the standby to promote); on-silence: promote on silence too")
    p.add_argument("--replication-ack-timeout-s", type=float, default=5.0,
                   help="a write waits this long for the standby's acknowledgement before the standby is dropped")


def _ha_options(args: argparse.Namespace) -> HAOptions | None:
    if not (args.standby_of or args.peer):
        return None
    tls = {"tls_ca": args.tls_client_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key} if args.tls_cert else {}
    return HAOptions(standby_of=args.standby_of, peer=args.peer or args.standby_of,
                     failover_timeout_s=args.failover_timeout_s, ack_timeout_s=args.replication_ack_timeout_s,
                     takeover=args.takeover,
                     channel=lambda addr: make_channel(addr, **tls))


def build_master(args: argparse.Namespace) -> MasterServer:
    config = MasterConfig(lease_ttl_s=args.lease_ttl_s, put_timeout_s=args.put_timeout_s, grace_s=args.grace_s,
                          node_timeout_s=args.node_timeout_s, high_watermark=args.high_watermark,
                          low_watermark=args.low_watermark, arena_max_fraction=args.arena_max_fraction)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    audit = HandshakeAudit("kvstore-master") if args.tls_cert else None
    creds = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca,
                               on_handshake=audit.on_handshake if audit else None) if args.tls_cert else None
    server = MasterServer(config, load_secret(args.secret_file, create=True), host=args.host, port=args.port,
                        data_dir=args.data_dir, fsync=args.fsync, snapshot_interval_s=args.snapshot_interval_s,
                        metrics_port=args.metrics_port, credentials=creds,
                        role_policy=restrict_feed(kvstore_policy()) if args.tls_cert and args.tls_client_ca else None,
                        ha=_ha_options(args), lookup_socket=args.lookup_socket)
    server.tls_audit = audit
    return server


def run_master(args: argparse.Namespace) -> int:
    server = build_master(args).start()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: server._stop.set())
        if server.ha is not None:  # the operator's "the primary is dead, promote" (kvstore/takeover.py)
            signal.signal(signal.SIGUSR1, lambda *_: server.ha.request_promotion())
    print(json.dumps({"event": "kvstore_master_ready", "address": server.address,
                      "metrics_port": server.metrics_port, "role": server.role}), flush=True)
    server.wait()
    server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdcluster kvstore master", description=__doc__.splitlines()[0])
    add_master_args(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_master(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
