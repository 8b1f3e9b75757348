"""Speculative decoding with n-gram drafts (--speculative-config) against plain decoding, offline.

    python benchmarks/spec_decode.py                                  # bench Llama, batch 1 and 8, k = 2 and 4
    python benchmarks/spec_decode.py --model-dir M --batch 1 --k 1 2 3 4 --max-tokens 256

Per configuration (plain = k 0) one engine, a warm-up, then --repeats timed runs of the same
seeded prompts (each a random phrase said --phrase-repeats times: the drafts find their n-grams
in the prompt, and in the output once it repeats itself). Printed: output tok/s (median), the
ratio to plain at the same batch, the share of drafts kept, tokens per draft-checking step, and
the median step time by tokens per step (what checking k drafts costs: with a share a of drafts
kept, a step yields (1 - a^(k+1)) / (1 - a) tokens for the time of its k + 1 rows). Outputs are
checked equal to plain's (greedy). With vLLM's CPU build at --vllm-python, vLLM runs the same
prompts with and without its own ngram drafts (same k and n-gram bounds, float32 by default):
its tok/s, and ours against it, side by side. Random-weight checkpoints repeat themselves more than trained
ones do, so their kept share flatters n-gram drafts; the step-cost column does not depend on it.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_model import ensure_bench_model  # noqa: E402

os.environ.setdefault("PDCLUSTER_COMPILE_START", "wait")


def _prompts(n: int, phrase_len: int, repeats: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(phrase_len)] * repeats for _ in range(n)]


def run(model: str, batch: int, k: int, args: argparse.Namespace, vocab: int) -> dict:
    from pdcluster import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
            "adaptive": not args.check_all} if k else None
    llm = LLM(model, max_model_len=2048, speculative_config=spec, compute_dtype=args.compute_dtype)
    runner = llm.engine.core.runner
    step_ms: dict[int, list[float]] = collections.defaultdict(list)
    execute = runner.execute

    def timed(so):  # step time by tokens in the step
        t0 = time.perf_counter()
        out = execute(so)
        step_ms[so.total_num_scheduled_tokens].append((time.perf_counter() - t0) * 1e3)
        return out

    runner.execute = timed
    prompts = [{"prompt_token_ids": p} for p in _prompts(batch, args.phrase_len, args.phrase_repeats, vocab, 0)]
    params = SamplingParams(temperature=args.temperature, seed=0 if args.temperature else None,
                            max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)  # warm-up (and the compile, if any)
    step_ms.clear()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t0)
    stats = llm.engine.get_stats()
    llm.engine.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    drafted = stats.get("spec_decode_draft_tokens", 0)
    return {"tok_s": batch * args.max_tokens / statistics.median(times), "tokens": tokens,
            "kept": stats.get("spec_decode_accepted_tokens", 0) / drafted if drafted else None,
            "per_check": ((stats.get("spec_decode_accepted_tokens", 0) + stats.get("spec_decode_drafts", 0))
                          / stats["spec_decode_drafts"]) if stats.get("spec_decode_drafts") else None,
            "steps": {n: statistics.median(v) for n, v in sorted(step_ms.items()) if len(v) >= 3}}


def run_vllm(python: str, model: str, batch: int, k: int, args: argparse.Namespace, vocab: int) -> dict:
    from vllm_env import run_vllm_offline

    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4} if k else None
    r = run_vllm_offline(python, model, {
        "prompts": _prompts(batch, args.phrase_len, args.phrase_repeats, vocab, 0), "max_tokens": [args.max_tokens] * batch,
        "repeats": args.repeats, "dtype": args.vllm_dtype, "speculative_config": spec, "max_model_len": 2048,
        "return_tokens": True})
    return {"tok_s": batch * args.max_tokens / statistics.median(r["times"]), "tokens": r["tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/pdcluster/bench-llama-125m"),
                    help="made on first use when it is the bench Llama's folder")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4], help="num_speculative_tokens values")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--phrase-len", type=int, default=48)
    ap.add_argument("--phrase-repeats", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compute-dtype", default="auto")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: seeded sampling (a draft is kept only where the row's own draw picks it)")
    ap.add_argument("--check-all", action="store_true",
                    help="adaptive off: check every draft found, as vLLM does (engine/draft_policy.py)")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python"),
                    help="a Python with vLLM's CPU build (skipped when absent)")
    ap.add_argument("--vllm-dtype", default="float32")
    args = ap.parse_args()
    model = ensure_bench_model(args.model_dir)
    import json

    import torch

    vocab = json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]
    flags = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f in open("/proc/cpuinfo").read()] \
        if platform.system() == "Linux" else []
    print(f"model {model}; threads {torch.get_num_threads()}; cpu flags {' '.join(flags)}; "
          f"{args.max_tokens} tokens per request, " + (f"temperature {args.temperature}, seeded" if args.temperature
                                                        else "greedy"))
    for batch in args.batch:
        use_vllm = os.path.exists(args.vllm_python) and not args.temperature  # its seeded draws are its own
        plain = run(model, batch, 0, args, vocab)
        print(f"\nbatch {batch}: plain {plain['tok_s']:.1f} tok/s; step ms by tokens "
              + ", ".join(f"{n}: {ms:.2f}" for n, ms in plain["steps"].items() if n <= 64))
        if use_vllm:
            v = run_vllm(args.vllm_python, model, batch, 0, args, vocab)
            print(f"  vLLM ({args.vllm_dtype}) plain {v['tok_s']:.1f} tok/s: ours {plain['tok_s'] / v['tok_s']:.2f}x; "
                  f"vLLM's tokens {'equal' if v['tokens'] == plain['tokens'] else 'differ'}")
        for k in args.k:
            r = run(model, batch, k, args, vocab)
            same = "equal" if r["tokens"] == plain["tokens"] else "DIFFERENT"
            kept = f"{r['kept']:.0%}" if r["kept"] is not None else "-"
            per = f"{r['per_check']:.2f}" if r["per_check"] is not None else "-"
            steps = ", ".join(f"{n}: {ms:.2f}" for n, ms in r["steps"].items() if n <= batch * (k + 1))
            print(f"  k={k}: {r['tok_s']:.1f} tok/s ({r['tok_s'] / plain['tok_s']:.2f}x plain), drafts kept {kept}, "
                  f"tokens per checking step {per}, outputs {same}; step ms by tokens {steps}")
            if use_vllm:
                v = run_vllm(args.vllm_python, model, batch, k, args, vocab)
                print(f"    vLLM ({args.vllm_dtype}) ngram k={k}: {v['tok_s']:.1f} tok/s: ours {r['tok_s'] / v['tok_s']:.2f}x; "
                      f"vLLM's tokens {'equal' if v['tokens'] == plain['tokens'] else 'differ'}")


if __name__ == "__main__":
    main()
