"""`pdcluster kvstore master|node`: the CLI wiring (the processes themselves run in every store test)."""

from __future__ import annotations

import subprocess
import sys

from pdcluster.cluster.cli import build_parser


def test_parses_kvstore_flags() -> None:
    args = build_parser().parse_args(["kvstore", "master", "--port", "0", "--lease-ttl-s", "2"])
    assert args.kvstore_command == "master" and args.port == 0 and args.lease_ttl_s == 2.0
    assert args.high_watermark == 0.95  # kvstore's own defaults
    node = build_parser().parse_args(["kvstore", "node", "--master", "127.0.0.1:1", "--size", "64M"])
    assert node.size == 64 << 20 and callable(node.func)


def test_help_stays_cheap() -> None:
    """Building the parser must not import grpc or the kvstore servers (`pdcluster --help` is fast)."""
    code = ("import sys; from pdcluster.cluster.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('grpc', 'pdcluster.kvstore.master', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_master_help_lists_kvstore_flags() -> None:
    out = subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "kvstore", "master", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--data-dir" in out and "--secret-file" in out
