"""Prefix-reuse workload for the store benchmark: two engine instances, shared long prefixes.

Requests arrive one at a time, alternating between instances A and B; request i uses prefix
(i // 2) % P plus its own suffix, so each prefix is first seen by A, then by B, then again by
both. Without a store B recomputes what A just computed; with the store connector B loads it.
Reported per mode: prefix hit rate (prompt tokens not computed: local prefix cache + store) and
TTFT (add to first token; requests are spaced, so TTFT is the prefill alone).

Both modes run in this process, two engines each; the store mode adds one kvstore master and node
(`pdcluster kvstore ...`) and the "store" connector on its engines. The modes take turns request
by request so that other load on the machine weighs on both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import time
from typing import Any

BENCH_MODEL = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
               "num_key_value_heads": 4, "max_position_embeddings": 4096}


def ensure_bench_model() -> str:
    """A ~90M-parameter random Llama with the demo tokenizer (prefill is real work on a CPU)."""
    import torch
    from safetensors.torch import save_file

    from pdcluster.models.demo import demo_model_dir, ensure_demo_model

    out = demo_model_dir().parent / "store-bench-model-v1"
    if (out / "model.safetensors").exists():
        return str(out)
    demo = pathlib.Path(ensure_demo_model())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp / name).write_bytes((demo / name).read_bytes())
    config = {**json.loads((demo / "config.json").read_text()), **BENCH_MODEL}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hd

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).contiguous()

    tensors = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h), "lm_head.weight": w(v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
                    p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
                    p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                    p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": torch.ones(h),
                    p + "post_attention_layernorm.weight": torch.ones(h)}
    save_file(tensors, str(tmp / "model.safetensors"))
    try:
        os.rename(tmp, out)  # atomic publish; another process may have won the race
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _engine(model: str, options: dict[str, Any] | None) -> Any:
    from pdcluster.config import EngineArgs
    from pdcluster.connectors import engine_connector_factory
    from pdcluster.engine.llm_engine import LLMEngine

    args = EngineArgs(model=model, num_kv_blocks=512, max_model_len=2048, block_size=16, seed=0, dtype="float32",
                      kv_connector="store" if options else None, kv_connector_options=options)
    return LLMEngine.from_engine_args(args, connector=engine_connector_factory if options else None)


def _one(engine: Any, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Run one request alone; (TTFT seconds, prompt tokens not computed). Waits for its saves."""
    from pdcluster.sampling_params import SamplingParams

    req, text = engine.prepare_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                       request_id, None, None)
    t0 = time.perf_counter()
    engine.add_prepared(req, text)
    ttft = None
    while True:
        for out in engine.step():
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            if out.finished:
                cached = engine.get_final(request_id).num_cached_tokens
                while engine.has_unfinished_requests():  # saves land before the next request
                    engine.step()
                assert ttft is not None
                return ttft, cached


def _workload(args: argparse.Namespace, vocab: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, vocab) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    return [(i % 2, prefixes[(i // 2) % args.num_prefixes] + [rng.randrange(3, vocab) for _ in range(args.suffix_len)])
            for i in range(args.num_requests)]


def run_prefix_reuse(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    from pdcluster.cluster.store_procs import LocalStores

    if args.prefix_model == "bench":
        model_path = ensure_bench_model()
    elif args.prefix_model == "demo":
        from pdcluster.models.demo import ensure_demo_model

        model_path = ensure_demo_model()
    else:
        model_path = args.prefix_model
    results: dict[str, Any] = {"model": os.path.basename(model_path), "prefix_len": args.prefix_len,
                               "suffix_len": args.suffix_len, "num_prefixes": args.num_prefixes,
                               "num_requests": args.num_requests}
    modes = ("no_store", "store")
    with LocalStores(os.path.join(workdir, "prefix")) as stores:
        master = stores.kvstore(node_size="1G")
        opts: dict[str, Any] = {"no_store": None, "store": {"master": master, "namespace": "bench-prefix"}}
        engines = {m: [_engine(model_path, opts[m]), _engine(model_path, opts[m])] for m in modes}
        try:
            for m in modes:  # first-forward costs (allocations, thread pools) out of the figures
                for j, e in enumerate(engines[m]):
                    for n in (40, args.prefix_len):
                        _one(e, f"warmup-{j}-{n}", [4 + j] * n)
            work = _workload(args, engines["store"][0].config.model.vocab_size)
            ttfts: dict[str, list[float]] = {m: [] for m in modes}
            cached = dict.fromkeys(modes, 0)
            # The modes take turns request by request, so a busy machine slows both alike.
            for i, (inst, prompt) in enumerate(work):
                for m in modes:
                    t, c = _one(engines[m][inst], f"{m}-{i}", prompt)
                    ttfts[m].append(t)
                    cached[m] += c
            total = sum(len(p) for _, p in work)
            for m in modes:
                t = ttfts[m]
                # The requests where B meets a prefix only A has computed: the store's case.
                b_first = [t[i] for i in range(1, min(len(work), 2 * args.num_prefixes), 2)]
                hits = sum(e.get_stats().get("kv_connector", {}).get("store_hit_tokens", 0) for e in engines[m])
                results[m] = {"hit_rate": cached[m] / total, "store_hit_tokens": hits,
                              "ttft_mean_ms": 1e3 * statistics.mean(t), "ttft_p50_ms": 1e3 * statistics.median(t),
                              "ttft_b_first_ms": 1e3 * statistics.mean(b_first) if b_first else 0.0,
                              "ttft_cold_ms": 1e3 * t[0]}
        finally:
            for es in engines.values():
                for e in es:
                    e.shutdown()
    return results


def prefix_table(r: dict[str, Any]) -> str:
    rows = ["| mode | prefix hit rate | store hit tokens | TTFT mean (ms) | TTFT p50 (ms) | TTFT, B's first "
            "sight of a prefix (ms) | TTFT cold (ms) |", "|---|---|---|---|---|---|---|"]
    for mode in ("no_store", "store"):
        m = r[mode]
        rows.append(f"| {mode} | {m['hit_rate']:.1%} | {m['store_hit_tokens']} | {m['ttft_mean_ms']:.1f} | "
                    f"{m['ttft_p50_ms']:.1f} | {m['ttft_b_first_ms']:.1f} | {m['ttft_cold_ms']:.1f} |")
    return "\n".join(rows)


__all__ = ["ensure_bench_model", "prefix_table", "run_prefix_reuse"]
