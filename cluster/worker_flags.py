"""serve-worker's flags as the Ray launcher sees them, read from serve-worker's own argument parser
(stdlib only, milliseconds): pool engine options are validated against them, flags added later
(TP, connectors) are picked up without a change here, and a launcher asking for a feature the
worker does not have yet fails before anything starts."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

# serve-worker dests the launcher fills from dedicated fields (pool.tp, connector), by the names
# they may have there.
WORKER_FLAG_DESTS = {"tp": ("tp", "tensor_parallel_size"), "connector": ("kv_connector", "connector"),
                     "connector_options": ("kv_connector_options", "connector_options")}
# serve-worker flags the launcher sets itself: not engine options.
RESERVED_WORKER_FLAGS = frozenset({
    "role", "model", "host", "port", "advertise_host", "worker_id", "key_dir", "key_name", "kv_events_allow",
    "tls_cert", "tls_key", "tls_ca", "func", *(d for dests in WORKER_FLAG_DESTS.values() for d in dests),
})


def worker_flag_actions() -> dict[str, argparse.Action]:
    """serve-worker's flags by dest, read from its own parser (stdlib only, milliseconds)."""
    from pdcluster.cluster.worker_cmd import add_serve_worker

    sub = argparse.ArgumentParser(add_help=False).add_subparsers()
    add_serve_worker(sub)
    parser = sub.choices["serve-worker"]
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def worker_flag(actions: Mapping[str, argparse.Action], what: str) -> str | None:
    """serve-worker's flag for `what` (a WORKER_FLAG_DESTS key), or None if it has none yet."""
    for dest in WORKER_FLAG_DESTS[what]:
        if dest in actions:
            return actions[dest].option_strings[0]
    return None


def engine_argv(engine: Mapping[str, Any], actions: Mapping[str, argparse.Action] | None = None) -> list[str]:
    """serve-worker flags for a pool's (validated) engine options."""
    actions = actions or worker_flag_actions()
    argv: list[str] = []
    for name, value in engine.items():
        flag = actions[name].option_strings[-1]
        if isinstance(actions[name], argparse._StoreTrueAction):
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv
