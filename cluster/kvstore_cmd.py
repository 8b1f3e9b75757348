"""`pdcluster kvstore master ...` and `pdcluster kvstore node ...`: the built-in KV store's processes.

    pdcluster kvstore master --port 50070 --data-dir ./kv-master --secret-file kv.secret
    pdcluster kvstore node --master 127.0.0.1:50070 --size 4G --secret-file kv.secret

A primary/standby pair (kvstore/standby.py): each names the other; nodes and clients take both.

    pdcluster kvstore master --port 50070 --data-dir ./kv-a --peer 127.0.0.1:50071 --secret-file kv.secret
    pdcluster kvstore master --port 50071 --data-dir ./kv-b --standby-of 127.0.0.1:50070 --secret-file kv.secret
    pdcluster kvstore node --master 127.0.0.1:50070,127.0.0.1:50071 --size 4G --secret-file kv.secret

The flags are kvstore's own (pdcluster.kvstore.master.add_master_args / node.add_node_args), so
`python -m pdcluster.kvstore.master` and this command take the same command lines. Each prints
one JSON ready line on stdout, then runs until SIGTERM/SIGINT.

kvstore's flag helpers live beside its servers, which import grpc (~0.8 s): the subcommand parsers
add those flags only when their own subcommand is parsed, so `pdcluster --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any


class _LazyFlagsParser(argparse.ArgumentParser):
    """An argparse parser that calls `populate(self)` the first time it parses or prints help."""

    def __init__(self, *args: Any, populate: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._populate = populate

    def _ensure(self) -> None:
        if self._populate is not None:
            populate, self._populate = self._populate, None
            populate(self)

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:  # before the flags' defaults are set
        self._ensure()
        return super().parse_known_args(*args, **kwargs)

    def format_help(self) -> str:
        self._ensure()
        return super().format_help()

    def format_usage(self) -> str:
        self._ensure()
        return super().format_usage()


def _master_flags(p: argparse.ArgumentParser) -> None:
    from pdcluster.kvstore.master import add_master_args

    add_master_args(p)


def _node_flags(p: argparse.ArgumentParser) -> None:
    from pdcluster.kvstore.node import add_node_args

    add_node_args(p)


def _cmd_master(args: argparse.Namespace) -> int:
    from pdcluster.kvstore.master import run_master

    _logging()
    return run_master(args)


def _cmd_node(args: argparse.Namespace) -> int:
    from pdcluster.kvstore.node import run_node

    _logging()
    return run_node(args)


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def add_kvstore_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kvstore", help="run the built-in KV store: its master or a storage node")
    ks = p.add_subparsers(dest="kvstore_command", required=True, parser_class=_LazyFlagsParser)
    master = ks.add_parser("master", help="metadata server (gRPC): placements, leases, eviction, op log",
                           populate=_master_flags)
    master.set_defaults(func=_cmd_master)
    node = ks.add_parser("node", help="storage node: mounts memory segments and serves them on the data plane",
                         populate=_node_flags)
    node.set_defaults(func=_cmd_node)


__all__ = ["add_kvstore_commands"]
