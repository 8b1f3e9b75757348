"""What the sampling masks cost a step: the Sampler call on a (batch, vocab) float32 logits tensor,
greedy, with every row plain, or carrying allowed_token_ids, bad_words, logit_bias or min_tokens
bans. Medians of --repeats calls, in one process, interleaved so the machine's swings hit every
variant alike.

    python benchmarks/sampler_masks.py                     # batch 1 and 32, Llama's 32,000 tokens
    python benchmarks/sampler_masks.py --batch 64 --vocab 151936
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdcluster.engine.sampler import Sampler, SamplingState
from pdcluster.sampling_params import SamplingParams


def variants(vocab: int) -> dict[str, SamplingParams]:
    g = torch.Generator().manual_seed(0)
    words = [[int(t) for t in torch.randint(3, vocab, (3,), generator=g)] for _ in range(126)]
    words += [[8, 9, 100], [200]]  # two that ban a token at every step (the output ends 8, 9)
    return {
        "plain": SamplingParams(temperature=0.0),
        "allowed_token_ids (100)": SamplingParams(temperature=0.0, allowed_token_ids=list(range(1000, 1100))),
        "bad_words (64 words, 128 seqs)": SamplingParams(temperature=0.0, bad_words=["w"] * 64,
                                                         bad_words_token_ids=words),
        "logit_bias (100)": SamplingParams(temperature=0.0, logit_bias={t: 1.0 for t in range(100)}),
        "min_tokens ban": SamplingParams(temperature=0.0, min_tokens=8, stop_token_ids=[5, 6]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, vocab={args.vocab}")
    sampler = Sampler(args.vocab)
    for batch in args.batch:
        logits = torch.randn(batch, args.vocab)
        output = [7, 8, 9]
        cases = {name: [SamplingState(p, [1, 2, 3], output, (2,)) for _ in range(batch)]
                 for name, p in variants(args.vocab).items()}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, states in cases.items():
                t0 = time.perf_counter()
                sampler(logits, states)
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["plain"])
        print(f"batch {batch}:")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"  {name:32s} {med * 1e3:7.3f} ms  (+{(med - base) * 1e3:.3f} ms over plain)")


if __name__ == "__main__":
    main()
