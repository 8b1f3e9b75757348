"""serve-worker's flags as the Ray launcher sees them, read from serve-worker's own argument parser
(stdlib only, milliseconds): pool engine options are validated against them, flags added later
(TP, connectors) are picked up without a change here, and a launcher asking for a feature the
worker does not have yet fails before anything starts."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

# serve-worker dests the launcher fills from dedicated fields (pool.tp, connector), by the names
# they may have there.
WORKER_FLAG_DESTS = {"tp": ("tp", "tensor_parallel_size"), "connector": ("kv_connector", "connector"),
                     "connector_options": ("kv_connector_options", "connector_options")}
# serve-worker flags the launcher sets itself: not engine options.
RESERVED_WORKER_FLAGS = frozenset({
    "role", "model", "host", "port", "advertise_host", "worker_id", "key_dir", "key_name", "kv_events_allow",
    "tls_cert", "tls_key", "tls_ca", "func", "ec_connector", "ec_connector_options", *(d for dests in WORKER_FLAG_DESTS.values() for d in dests),
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
        argv += _flag_argv(actions[name].option_strings[-1], isinstance(actions[name], argparse._StoreTrueAction),
                           value)
    return argv


def _flag_argv(flag: str, switch: bool, value: Any) -> list[str]:
    """One option as argv: a switch present or not, a YAML mapping (speculative_config) as its JSON
    text, anything else as its str; None: nothing."""
    if switch:
        return [flag] if value else []
    if isinstance(value, (dict, list)):
        return [flag, json.dumps(value)]
    return [] if value is None else [flag, str(value)]


# -- engine flags, by vLLM's names ------------------------------------------------------------------
# (flag, serve-worker dest, type): what serve-worker takes and `serve`/`up` forward to their pools.
# Booleans: enable_prefix_caching (--enable-prefix-caching / --no-enable-prefix-caching) and
# enforce_eager (no torch.compile of the forward: engine/compiled_forward.py).
ENGINE_FLAGS: tuple[tuple[str, str, Any], ...] = (
    ("--dtype", "dtype", str), ("--kv-cache-dtype", "kv_cache_dtype", str), ("--device", "device", str),
    ("--block-size", "block_size", int), ("--max-model-len", "max_model_len", int),
    ("--max-num-seqs", "max_num_seqs", int), ("--max-num-batched-tokens", "max_num_batched_tokens", int),
    ("--kv-cache-memory-bytes", "kv_cache_memory_bytes", int), ("--num-kv-blocks", "num_kv_blocks", int),
    ("--seed", "seed", int), ("--enable-prefix-caching", "enable_prefix_caching", bool),
    ("--enforce-eager", "enforce_eager", bool), ("--enable-expert-parallel", "enable_expert_parallel", bool),
    ("--scheduling-policy", "scheduling_policy", str), ("--speculative-config", "speculative_config", str),
    ("--kv-load-wait-ms", "kv_load_wait_ms", float),
    ("--long-prefill-token-threshold", "long_prefill_token_threshold", int),
)
ENGINE_DEFAULTS = {"dtype": "auto", "kv_cache_dtype": "auto", "device": "auto", "block_size": 16, "max_num_seqs": 64,
                   "seed": 0, "scheduling_policy": "fcfs", "kv_load_wait_ms": 0.0, "long_prefill_token_threshold": 0}
ENGINE_HELP = {
    "kv_cache_memory_bytes": "KV cache budget in bytes (default: from free memory); --num-kv-blocks overrides it",
    "max_model_len": "context length (default: the model's)",
    "enforce_eager": "run the forward eagerly: no torch.compile (engine/compiled_forward.py)",
    "enable_expert_parallel": "MoE models: partition the experts across the tensor-parallel ranks",
    "scheduling_policy": "fcfs (default) or priority: requests' `priority` (lower first) orders admission and "
                         "preemption",
    "kv_load_wait_ms": "decode workers: a step that starts KV loads runs nothing else, and the running requests "
                       "wait up to this long for them, so loaded requests join the next step (0: off; "
                       "SchedulerConfig.kv_load_wait_s)",
    "long_prefill_token_threshold": "a prompt chunk computes at most this many tokens per step (0: up to "
                                    "--max-num-batched-tokens): on a decode worker that also prefills, a step "
                                    "stalls its running decodes for a chunk, not a whole prompt",
    "speculative_config": "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                          "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2} (engine/ngram_proposer.py)",
}
POOL_PREFIXES = ("prefill", "decode", "encode")


def add_engine_flags(group: Any) -> None:
    """serve-worker's engine flags. Prefix caching keeps its dest `no_prefix_caching` (YAML pool
    engines name it so); --enable-prefix-caching is defined first so that the dest's last action
    (what worker_flag_actions keeps) is the store_true one."""
    for flag, dest, kind in ENGINE_FLAGS:
        if dest == "enable_prefix_caching":
            # default=False on both actions: argparse takes the dest's default from the first.
            group.add_argument("--enable-prefix-caching", dest="no_prefix_caching", action="store_false",
                               default=False, help="on by default")
            group.add_argument("--no-enable-prefix-caching", "--no-prefix-caching", dest="no_prefix_caching",
                               action="store_true", default=False)
        elif kind is bool:
            group.add_argument(flag, dest=dest, action="store_true", help=ENGINE_HELP.get(dest))
        else:
            group.add_argument(flag, dest=dest, type=kind, default=ENGINE_DEFAULTS.get(dest), help=ENGINE_HELP.get(dest))


def engine_kwargs(args: Any) -> dict[str, Any]:
    """serve-worker's engine flags as EngineArgs fields."""
    out = {dest: getattr(args, dest) for _, dest, kind in ENGINE_FLAGS if kind is not bool}
    out["enable_prefix_caching"] = not args.no_prefix_caching
    out["enable_expert_parallel"] = bool(getattr(args, "enable_expert_parallel", False))
    out["enforce_eager"] = bool(getattr(args, "enforce_eager", False))
    return out


def add_forwarded_engine_flags(parser: argparse.ArgumentParser) -> None:
    """`serve`/`up`: the engine flags for every pool, and --prefill-FLAG / --decode-FLAG for one
    pool (help suppressed: one line per flag and pool would bury the rest)."""
    g = parser.add_argument_group("engine (vLLM's flags, forwarded to every worker; --prefill-FLAG, "
                                  "--decode-FLAG and --encode-FLAG set one pool, e.g. --decode-max-num-seqs 256)")
    for prefix in ("", *POOL_PREFIXES):
        for flag, dest, kind in ENGINE_FLAGS:
            name = flag if not prefix else f"--{prefix}-{flag[2:]}"
            d = f"engine_{prefix + '_' if prefix else ''}{dest}"
            hidden = argparse.SUPPRESS if prefix else ENGINE_HELP.get(dest)
            if dest == "enable_prefix_caching":
                g.add_argument(name, dest=d, action=argparse.BooleanOptionalAction, default=None, help=hidden)
            elif kind is bool:
                g.add_argument(name, dest=d, action="store_const", const=True, default=None, help=hidden)
            else:
                g.add_argument(name, dest=d, type=kind, default=None, help=hidden, metavar=dest.upper())


def pool_engine_argv(pool: str, engine: Mapping[str, Any]) -> list[str]:
    """`serve` flags that set one pool's engine options (--decode-max-num-seqs 8, ...): the
    inverse of forwarded_engine for that pool. `engine` is by serve-worker dest, as a YAML pool's."""
    if pool not in POOL_PREFIXES:
        raise ValueError(f"pool must be one of {POOL_PREFIXES}, got {pool!r}")
    flags = {dest: (flag, kind) for flag, dest, kind in ENGINE_FLAGS}
    argv: list[str] = []
    for dest, value in engine.items():
        if dest == "no_prefix_caching":
            argv.append(f"--{'no-' if value else ''}{pool}-enable-prefix-caching")  # BooleanOptionalAction's pair
            continue
        if dest not in flags:
            raise ValueError(f"{pool} engine option {dest!r}: not an engine flag")
        flag, kind = flags[dest]
        argv += _flag_argv(f"--{pool}-{flag[2:]}", kind is bool, value)
    return argv


def forwarded_engine(args: Any, pool: str) -> dict[str, Any]:
    """The engine flags given for `pool` ("both", "prefill", "decode" or "encode"), by serve-worker dest
    (a YAML pool's `engine` section): the every-pool value, then the pool's own over it."""
    out: dict[str, Any] = {}
    prefixes = ["", pool] if pool in POOL_PREFIXES else [""]
    for prefix in prefixes:
        for _, dest, _ in ENGINE_FLAGS:
            value = getattr(args, f"engine_{prefix + '_' if prefix else ''}{dest}", None)
            if value is None:
                continue
            if dest == "enable_prefix_caching":
                out["no_prefix_caching"] = not value
            else:
                out[dest] = value
    return out
