"""TLS rotation reaching a running `pdcluster up` (ray_tls_push.py does the push):

    foreground `up`       SIGHUP, or --key-dir's tls/ca.pem or ca.key changed (checked each
                          watch period, 5 s): re-read the CA, push every actor its new identity;
                          afterwards, actors restarted with their start-up identity get a current one
    pdcluster up --reload-keys [--namespace NS] [--key-dir DIR]
                          the same push from another process (a detached cluster); DIR defaults
                          to the --key-dir the cluster was started with (its state file)

So `pdcluster keys rotate-ca DIR` / `keys reissue` / `keys revoke-ca DIR` on the operator's folder
reach the actors without a restart.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any


class KeyWatch:
    """When a foreground `up` pushes a rotation: after SIGHUP, or when the CA files changed."""

    def __init__(self, key_dir: str | None) -> None:
        self.paths = [os.path.join(key_dir, "tls", n) for n in ("ca.pem", "ca.key")] if key_dir else []
        self.stamp = self._stamp()
        self.requested = False

    def _stamp(self) -> tuple:
        out = []
        for p in self.paths:
            try:
                st = os.stat(p)
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def arm(self) -> None:
        """SIGHUP asks for a reload (the `up` process keeps running)."""
        signal.signal(signal.SIGHUP, self._hup)

    def _hup(self, signum: int, frame: Any) -> None:
        self.requested = True

    def due(self) -> bool:
        return self.requested or self._stamp() != self.stamp

    def done(self) -> None:
        self.stamp, self.requested = self._stamp(), False


def maybe_reload(launcher: Any, watch: KeyWatch) -> None:
    """One watch period of a foreground `up`: push a rotation if one is due, else refresh
    restarted actors; what happened is printed on stderr."""
    if launcher.tls is None:
        return
    if watch.due():
        try:
            report = launcher.reload_tls()
        except ValueError as e:  # a rotation half written (ca.key new, ca.pem old): next period
            print(f"pdcluster up: TLS reload postponed: {e}", file=sys.stderr)
            return
        except Exception as e:  # the watch loop must go on; SIGHUP retries
            watch.done()
            print(f"pdcluster up: TLS reload failed: {type(e).__name__}: {e}", file=sys.stderr)
            return
        watch.done()
        print(f"pdcluster up: {describe(report)}", file=sys.stderr)
        return
    try:
        fixed = launcher.refresh_tls()
    except Exception as e:  # the watch loop must go on
        print(f"pdcluster up: TLS refresh failed: {e}", file=sys.stderr)
        return
    if fixed:
        print(f"pdcluster up: TLS: restarted actor(s) {', '.join(sorted(fixed))} given current identities",
              file=sys.stderr)


def describe(report: Mapping[str, Any]) -> str:
    phases = report.get("phases", {})
    if report.get("complete"):
        ca = "" if "ca_changed" not in report else \
            f", CA {'changed' if report['ca_changed'] else 'unchanged'} in the key folder"
        return f"TLS rotation pushed to {phases['prune']['ok']} actor(s): new certificates and CA bundle{ca}"
    failed = {p: r["failed"] for p, r in phases.items() if r["failed"]}
    return f"TLS rotation incomplete (stopped at {', '.join(failed)}): {failed}; SIGHUP or --reload-keys to retry"


def run_reload_keys(args: argparse.Namespace) -> int:
    """`pdcluster up --reload-keys`: push a rotation to the cluster of --namespace."""
    from pdcluster.cluster.up_cmd import _connect

    ns, state, _ = _connect(args, required=True)
    import ray

    from pdcluster.cluster.ray_tls_push import reload_cluster_tls

    try:
        if state is not None and state.get("internal_tls") is False:
            print("pdcluster up: error: this cluster runs internal gRPC without TLS (--insecure-internal)",
                  file=sys.stderr)
            return 1
        key_dir = args.key_dir or (state or {}).get("tls_key_dir")
        try:
            report = reload_cluster_tls(ns, key_dir)
        except ValueError as e:
            print(f"pdcluster up: error: {e}", file=sys.stderr)
            return 1
    finally:
        ray.shutdown()
    print(f"pdcluster up: {describe(report)}")
    return 0 if report["complete"] else 1
