"""`pdcluster bench ...` argument parsing. Only argparse here: the implementation is imported when
the subcommand runs, so `pdcluster --help` stays fast.

`bench serve` takes `vllm bench serve`'s flag names with their meanings, so a command line moves
between the two tools unchanged.
"""

from __future__ import annotations

import argparse

DATASETS = ("random", "random-mm", "prefix-repetition", "trace", "jsonl")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def _cmd_serve(args: argparse.Namespace) -> int:
    from pdcluster.cluster.bench.serve import run_serve

    return run_serve(args)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=("pdcluster", "openai", "openai-chat"), default=None,
                   help="pdcluster: gRPC to the router; openai: /v1/completions; openai-chat: "
                        "/v1/chat/completions (default: pdcluster with --router, else openai)")
    g.add_argument("--base-url", default=None, help="http://HOST:PORT of an OpenAI-compatible server "
                                                     "(overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=None,
                   help="API path (default: /v1/completions, or /v1/chat/completions for openai-chat)")
    g.add_argument("--router", default=None, metavar="HOST:PORT", help="pdcluster router (gRPC)")
    g.add_argument("--model", default=None, help="model name sent with each request (default: the "
                                                 "server's first model); also the default --tokenizer")
    g.add_argument("--served-model-name", default=None, help="name to send instead of --model")
    g.add_argument("--tokenizer", default=None,
                   help="local HF directory with tokenizer.json, used to build and count prompts")
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")

    g = p.add_argument_group("traffic")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second; inf sends all at once (default)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma-distributed gaps: 1 Poisson, <1 burstier, >1 more regular")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests to send (default: 1000; every line of a trace or JSONL file)")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--skip-initial-test", action="store_true",
                   help="do not send one test request before the run (it checks the flags early)")
    g.add_argument("--num-warmups", type=int, default=0,
                   help="warm-up requests sent all at once and awaited before the measured run, not "
                        "counted in the results (same shape as the workload, other prompts)")

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="JSONL prompts ({\"prompt\", \"output_len\"}) "
                                                        "or, with --dataset-name trace, the trace")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len * (1 - r), len * (1 + r)]")
    g.add_argument("--random-prefix-len", type=int, default=0, help="tokens of a prefix shared by all")
    g.add_argument("--random-mm-base-items-per-request", type=int, default=1,
                   help="random-mm: images per request around this number")
    g.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0,
                   help="random-mm: items drawn uniformly in [floor(n(1-r)), ceil(n(1+r))], capped by the limits")
    g.add_argument("--random-mm-limit-mm-per-prompt", default='{"image": 255, "video": 1}',
                   help="random-mm: JSON caps per modality, e.g. '{\"image\": 3, \"video\": 0}'")
    g.add_argument("--random-mm-bucket-config", default="{(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}",
                   help="random-mm: {(height, width, frames): probability}; images only (frames 1)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--trace-file", default=None, help="Mooncake trace (JSONL: timestamp ms, input_length, "
                                                      "output_length, hash_ids); implies --dataset-name trace")
    g.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="multiply trace timestamps (0.5 replays twice as fast)")
    g.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash id")
    g.add_argument("--jsonl-output-len", type=int, default=256, help="output_len of JSONL lines without one")

    g = p.add_argument_group("sampling")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly the requested output length")
    g.add_argument("--temperature", type=float, default=0.0)

    g = p.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs, e.g. ttft:200 tpot:50 e2el:5000; goodput counts requests meeting all")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help=f"comma-separated, of {','.join(PERCENTILE_METRICS)}")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None)
    g.add_argument("--label", default=None, help="names the run (default: the backend)")
    g.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                   help="recorded in the result JSON, e.g. the cluster config")
    g.add_argument("--disable-tqdm", action="store_true")


def _cmd_transfer(args: argparse.Namespace) -> int:
    if args.connector == "store":
        from pdcluster.cluster.bench.store_transfer import run_store_bench

        run_store_bench(args)
        return 0
    from pdcluster.cluster.bench.transfer import run_transfer_bench

    run_transfer_bench(args)
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from pdcluster.cluster.bench.sweep import run_sweep

    return run_sweep(args)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `pdcluster bench` and its subcommands on the top-level CLI."""
    bench = sub.add_parser("bench", help="benchmarks (serve: online load generator, vLLM-compatible)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser(
        "serve", help="load a running cluster or OpenAI-compatible server; TTFT/TPOT/ITL/goodput",
        description="Online serving benchmark with `vllm bench serve`'s flags, metrics and result JSON.")
    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)
    transfer = bench_sub.add_parser(
        "transfer", help="KV connector throughput between two processes vs raw TCP and memcpy")
    from pdcluster.cluster.bench.store_transfer import add_store_bench_args
    from pdcluster.cluster.bench.transfer import add_transfer_args  # argparse only at import

    transfer.add_argument("--connector", choices=("p2p", "store"), default="p2p",
                          help="p2p: connector vs raw TCP/memcpy; store: put/get vs raw TCP/memcpy and Mooncake")
    add_transfer_args(transfer)
    add_store_bench_args(transfer.add_argument_group("store (--connector store)"), shared=True)
    transfer.set_defaults(func=_cmd_transfer)
    sweep = bench_sub.add_parser(
        "sweep", help="bench serve at several rates against several cluster configurations; plots, ratios")
    from pdcluster.cluster.bench.sweep import add_sweep_arguments  # argparse only at import

    add_sweep_arguments(sweep)
    sweep.set_defaults(func=_cmd_sweep)
