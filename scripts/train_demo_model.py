"""Train pdcluster's demo model: a small Llama on text that ships with Python, on one CPU thread.

Data: `pydoc_data.topics` (the language reference topics `help()` shows) and the docstrings of the
standard library's own modules, read with `ast` from their source files (no import, so no module
side effects), in sorted order. Docstrings of functions and classes are written under their
signature (`def name(args):` + the docstring), so the model learns Python-looking text as well as
English. Every tenth module file and every tenth topic is held out: never seen by the tokenizer or
the model, used for the held-out perplexity. idlelib is left out entirely (its text files are the
test's vocabulary the model did not train on, tests/models/test_demo_model.py).

Documents are joined with the BOS token `<s>` (the engine puts one in front of every prompt, so a
prompt looks like the start of a document); EOS never occurs in training, so the model does not
end its answers early. Output: an HF-format checkpoint (bf16 safetensors, float32 compute dtype in
config.json) and a loss log + plot under benchmarks/results/demo-model/.

    .venv/bin/python scripts/train_demo_model.py                 # ~20 min on one thread
    .venv/bin/python scripts/train_demo_model.py --steps 50      # smoke run
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import math
import os
import pathlib
import random
import sys
import sysconfig
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: the root's kernels/ must not shadow site-packages' `kernels`

from pdcluster.models import demo  # noqa: E402 - after the sys.path line, so the script runs from a checkout

EXCLUDED_PARTS = {"test", "tests", "idle_test", "idlelib", "site-packages", "turtledemo", "encodings",
                  "__pycache__", "lib2to3", "ensurepip", "_distutils_hack", "pydoc_data"}
HELDOUT_EVERY = 10


def stdlib_files() -> list[pathlib.Path]:
    base = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(base):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_PARTS]  # prune: site-packages alone is huge
        files += [pathlib.Path(folder, n) for n in names if n.endswith(".py") and not n.startswith("_sysconfigdata")]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def _docs_of_file(path: pathlib.Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    doc = ast.get_docstring(tree)
    if doc and len(doc) > 40:
        out.append(doc)
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 20:
            continue
        if isinstance(node, ast.ClassDef):
            head = f"class {node.name}:"
        else:
            head = f"def {node.name}({ast.unparse(node.args)}):"
        body = "\n".join(("    " + line) if line else "" for line in doc.splitlines())
        out.append(f'{head}\n    """\n{body}\n    """')
    return out


def build_corpus() -> tuple[list[str], list[str]]:
    """(train documents, held-out documents), always in the same order."""
    import pydoc_data.topics

    train, heldout = [], []
    for i, key in enumerate(sorted(pydoc_data.topics.topics)):
        (heldout if i % HELDOUT_EVERY == 0 else train).append(pydoc_data.topics.topics[key].strip())
    for i, path in enumerate(stdlib_files()):
        (heldout if i % HELDOUT_EVERY == 3 else train).extend(_docs_of_file(path))
    return train, heldout


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=demo.SPECIAL_TOKENS,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    return tok


def token_stream(tok, docs: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(docs):  # post-processor puts <s> in front of every document
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def make_model(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = demo.hf_config(vocab_size)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    return LlamaForCausalLM(config), cfg


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq: int, max_windows: int) -> float:
    model.eval()
    n = min(max_windows, (len(stream) - 1) // seq)
    total, count = 0.0, 0
    for i in range(0, n, 16):
        rows = torch.stack([stream[j * seq: j * seq + seq + 1] for j in range(i, min(n, i + 16))])
        logits = model(input_ids=rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1),
                                                 reduction="sum")
        total, count = total + loss.item(), count + rows[:, 1:].numel()
    model.train()
    return total / count


def save_checkpoint(model, tok, cfg: dict, out: pathlib.Path) -> None:
    """Write the HF checkpoint into `out`, each file replaced atomically (`ensure_demo_model` may copy
    from this directory while a run is saving into it)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    stage = out / ".staging"
    stage.mkdir(exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
               if "rotary_emb" not in k}
    save_file(tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
    (stage / "model.safetensors").chmod(0o644)  # save_file creates it 0600; it ships in the repo
    demo.write_config_files(stage, cfg)
    tok.save(str(stage / "tokenizer.json"))
    for f in stage.iterdir():
        os.replace(f, out / f.name)
    stage.rmdir()


def write_log(rows: list[dict], results: pathlib.Path) -> None:
    with open(results / "loss.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, results / "loss.png")


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["tokens"] / 1e6 for r in rows], [r["train_loss"] for r in rows], label="train (smoothed)")
    ev = [r for r in rows if r["heldout_loss"] != ""]
    ax.plot([r["tokens"] / 1e6 for r in ev], [r["heldout_loss"] for r in ev], "o-", label="held-out")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("pdcluster demo model (Llama, hidden 256, 4 layers) on Python's own docs")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "pdcluster" / "models" / "demo-checkpoint"))
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "demo-model"))
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the machine is shared; the run is sized for one thread
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out, results = pathlib.Path(args.out), pathlib.Path(args.results)
    results.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    train_docs, held_docs = build_corpus()
    tok = train_tokenizer(train_docs, args.vocab_size)
    train_ids, held_ids = token_stream(tok, train_docs), token_stream(tok, held_docs)
    data = {"train_docs": len(train_docs), "heldout_docs": len(held_docs), "train_chars": sum(map(len, train_docs)),
            "heldout_chars": sum(map(len, held_docs)), "train_tokens": len(train_ids), "heldout_tokens": len(held_ids),
            "vocab_size": tok.get_vocab_size(), "prep_s": round(time.time() - t0, 1)}
    print(json.dumps(data), flush=True)

    model, cfg = make_model(tok.get_vocab_size())
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine down to a tenth
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    rows: list[dict] = []
    smooth, t_train, cpu_train = None, time.time(), time.process_time()
    hi = len(train_ids) - args.seq - 1
    for step in range(args.steps):
        starts = [rng.randrange(hi) for _ in range(args.batch)]
        batch = torch.stack([train_ids[s: s + args.seq + 1] for s in starts])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        last = step == args.steps - 1
        row = {"step": step + 1, "tokens": (step + 1) * args.batch * args.seq, "train_loss": round(smooth, 4),
               "heldout_loss": "", "lr": round(lr_at(step), 6), "elapsed_s": round(time.time() - t_train, 1),
               "cpu_s": round(time.process_time() - cpu_train, 1)}
        if (step + 1) % 10 == 0 or (step + 1) % args.eval_every == 0 or last:
            rows.append(row)
        if (step + 1) % args.eval_every == 0 or last:
            row["heldout_loss"] = round(heldout_loss(model, held_ids, args.seq, args.eval_windows), 4)
            print(json.dumps(row), flush=True)
            save_checkpoint(model, tok, cfg, out)  # as we go: a killed run still leaves a model and its log
            write_log(rows, results)
    train_s, train_cpu_s = time.time() - t_train, time.process_time() - cpu_train

    final = heldout_loss(model, held_ids, args.seq, 10**9)  # every held-out window, not just the sample
    summary = {**data, "params": params, "steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr,
               "threads": 1, "train_wall_s": round(train_s, 1),
               "train_cpu_s": round(train_cpu_s, 1), "final_train_loss_smoothed": rows[-1]["train_loss"],
               "heldout_loss": round(final, 4), "heldout_perplexity": round(math.exp(final), 2),
               "heldout_tokens_scored": min(len(held_ids) - 1, ((len(held_ids) - 1) // args.seq) * args.seq),
               "command": "python scripts/train_demo_model.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
