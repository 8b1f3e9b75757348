"""The `pdcluster` command line. Every subcommand imports its implementation lazily so that
`pdcluster --help`, the router and the client never pay for torch or triton."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

DEFAULT_PROMPT = "The prefill pool reads the whole prompt"


def _cmd_generate(args: argparse.Namespace) -> int:
    from pdcluster.cluster.generate_cmd import run_generate

    return run_generate(args)


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from pdcluster.models.demo import ensure_demo_model

    print(ensure_demo_model(args.path))
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text (locally, or through a router with --router)")
    p.add_argument("--model", default=None, help="local HF model directory (default: the built-in demo model)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--router", default=None, help="HOST:PORT of a pdcluster router (gRPC)")
    p.add_argument("--api-key", default=None, help="the router's --api-key (default $PDCLUSTER_API_KEY)")
    p.add_argument("--tls-ca", default=None, help="CA of the router's certificate: reach it over TLS")
    p.set_defaults(func=_cmd_generate)


def _add_demo_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo-model", help="write the built-in demo model (HF format) and print its path")
    p.add_argument("path", nargs="?", default=None)
    p.set_defaults(func=_cmd_demo_model)


def _add_serve_worker(sub: argparse._SubParsersAction) -> None:
    from pdcluster.cluster.worker_cmd import add_serve_worker  # stdlib-only at import: cheap

    add_serve_worker(sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from pdcluster.cluster.bench import add_bench_parser  # argparse only; the run imports the rest

    add_bench_parser(sub)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from pdcluster.cluster.router_cmd import add_router  # stdlib-only at import: cheap
    from pdcluster.cluster.serve_cmd import add_serve

    add_serve(sub)
    add_router(sub)


def _cmd_keys_init(args: argparse.Namespace) -> int:
    from pdcluster.security.keys import KeyMaterialError, init_keys

    try:
        keys = init_keys(args.dir, overwrite=args.overwrite)
    except KeyMaterialError as e:
        raise ValueError(str(e)) from None
    names = ", ".join(sorted(keys.keypairs))
    print(f"wrote CURVE keys to {args.dir} (secrets mode 0600): {names}")
    from pdcluster.security.pki import TLS_DIR, init_pki

    if args.overwrite:
        import shutil

        shutil.rmtree(f"{args.dir}/{TLS_DIR}", ignore_errors=True)
    try:  # the mTLS identities of the internal gRPC planes: a CA and one certificate per instance
        init_pki(args.dir, DEFAULT_TLS_INSTANCES)
    except KeyMaterialError as e:
        raise ValueError(str(e)) from None
    print(f"wrote a cluster CA and certificates to {args.dir}/{TLS_DIR} (keys mode 0600): "
          + ", ".join(f"{name} ({role})" for role, name in DEFAULT_TLS_INSTANCES)
          + "; more with `pdcluster keys issue DIR ROLE NAME`")
    return 0


# One certificate per default instance; a deployment issues one per process (`keys issue`).
DEFAULT_TLS_INSTANCES = (("router", "router"), ("worker", "worker"), ("kvstore-master", "kvstore-master"),
                         ("kvstore-node", "kvstore-node"), ("client", "client"))


def _cmd_keys_issue(args: argparse.Namespace) -> int:
    from pdcluster.security.keys import KeyMaterialError
    from pdcluster.security.pki import ClusterCA

    try:
        ident = ClusterCA(args.dir).issue(args.role, args.name, hosts=args.host)
    except (KeyMaterialError, FileExistsError) as e:
        raise ValueError(f"cannot issue {args.name!r}: {e}") from None
    print(f"issued {ident.uri}: {ident.cert} (key {ident.key}, mode 0600)")
    return 0


def _cmd_keys_rotate(args: argparse.Namespace) -> int:
    from pdcluster.security.keys import KeyMaterialError, rotate_key

    for name in args.name:
        try:
            kp = rotate_key(args.dir, name)
        except (KeyMaterialError, FileExistsError) as e:
            raise ValueError(f"cannot rotate {name!r}: {e}") from None
        print(f"wrote {kp.name} beside {name}: servers accept both once they re-read {args.dir}")
    print(f"move clients to the NAME.next secrets, then `pdcluster keys revoke {args.dir} NAME`")
    return 0


def _cmd_keys_revoke(args: argparse.Namespace) -> int:
    from pdcluster.security.keys import KeyMaterialError, revoke_old_key

    for name in args.name:
        try:
            revoke_old_key(args.dir, name)
        except KeyMaterialError as e:
            raise ValueError(str(e)) from None
        print(f"{name}: the old key is revoked; {name}.next is now {name}")
    return 0


def _cmd_keys_rotate_ca(args: argparse.Namespace) -> int:
    from pdcluster.security.keys import KeyMaterialError
    from pdcluster.security.pki import begin_ca_rotation, instance_names

    try:
        ca = begin_ca_rotation(args.dir)
        names = [] if args.bundle_only else instance_names(args.dir)
        for name in names:
            ca.reissue(name)
    except (KeyMaterialError, OSError) as e:
        raise ValueError(f"cannot rotate the CA: {e}") from None
    print(f"new CA in {ca.ca_path} (bundle: new + old); reissued: {', '.join(names) or 'none'}")
    print(f"when every process runs on the new certificates: `pdcluster keys revoke-ca {args.dir}`")
    return 0


def _cmd_keys_reissue(args: argparse.Namespace) -> int:
    from pdcluster.security.keys import KeyMaterialError
    from pdcluster.security.pki import ClusterCA

    try:
        ca = ClusterCA(args.dir)
        for name in args.name:
            print(f"reissued {ca.reissue(name).uri} from the current CA")
    except (KeyMaterialError, OSError) as e:
        raise ValueError(f"cannot reissue: {e}") from None
    return 0


def _cmd_keys_revoke_ca(args: argparse.Namespace) -> int:
    from pdcluster.security.pki import finish_ca_rotation

    try:
        finish_ca_rotation(args.dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot revoke the old CA: {e}") from None
    print("old CA removed from the bundle: new handshakes with its certificates fail")
    return 0


def _add_key_rotation(ks: argparse._SubParsersAction) -> None:
    for cmd, func, what in (("rotate", _cmd_keys_rotate, "write NAME.next CURVE key pairs beside NAME (both allowed)"),
                            ("revoke", _cmd_keys_revoke, "revoke the old CURVE keys: NAME.next replaces NAME"),
                            ("reissue", _cmd_keys_reissue, "new certificate and key for instances, same role")):
        p = ks.add_parser(cmd, help=what)
        p.add_argument("dir")
        p.add_argument("name", nargs="+")
        p.set_defaults(func=func)
    rot = ks.add_parser("rotate-ca", help="new cluster CA beside the old (bundle) and reissue every certificate")
    rot.add_argument("dir")
    rot.add_argument("--bundle-only", action="store_true", help="make the CA bundle, reissue later (`keys reissue`)")
    rot.set_defaults(func=_cmd_keys_rotate_ca)
    rev = ks.add_parser("revoke-ca", help="drop the old CA from the bundle")
    rev.add_argument("dir")
    rev.set_defaults(func=_cmd_keys_revoke_ca)


def _add_keys(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="cluster key management")
    ks = p.add_subparsers(dest="keys_command", required=True)
    init = ks.add_parser("init", help="make CURVE key pairs and a cluster CA with certificates for router, "
                                      "workers, kvstore and clients")
    init.add_argument("dir")
    init.add_argument("--overwrite", action="store_true", help="replace existing keys")
    init.set_defaults(func=_cmd_keys_init)
    issue = ks.add_parser("issue", help="issue a certificate for one more instance from DIR's cluster CA")
    issue.add_argument("dir")
    issue.add_argument("role", help="router, worker, kvstore-master, kvstore-node or client")
    issue.add_argument("name", help="the instance's name (e.g. prefill-0): its certificate's identity")
    issue.add_argument("--host", action="append", default=[], help="an extra DNS name or IP it serves on")
    issue.set_defaults(func=_cmd_keys_issue)
    _add_key_rotation(ks)


def _add_up(sub: argparse._SubParsersAction) -> None:
    from pdcluster.cluster.up_cmd import add_up_commands  # stdlib-only at import: cheap

    add_up_commands(sub)  # up, status, down


def _add_kvstore(sub: argparse._SubParsersAction) -> None:
    from pdcluster.cluster.kvstore_cmd import add_kvstore_commands  # stdlib-only at import: cheap

    add_kvstore_commands(sub)  # kvstore master, kvstore node


# Helpers adding a subcommand: append to this list (one builder per subcommand family).
_BUILDERS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_generate,
    _add_demo_model,
    _add_keys,
    _add_bench,
    _add_serve_worker,
    _add_serve,
    _add_up,
    _add_kvstore,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for build in _BUILDERS:
        build(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as e:  # bad flags, files, ports: one line, no traceback
        print(f"pdcluster {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
