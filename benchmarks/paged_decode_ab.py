"""The CPU decode-attention kernel (kernels/csrc/paged_decode_cpu.c) as it is now against the same
file at another git revision, interleaved call by call in one process (this VM's speed moves
within minutes, so two separate runs compare phases, not kernels).

    python benchmarks/paged_decode_ab.py                       # working tree vs HEAD
    python benchmarks/paged_decode_ab.py --rev HEAD~3 --threads 1

Both builds use kernels/native.py's compiler flags, into a temporary folder. Cases are
(batch, context) pairs over the 125M bench Llama's heads (12 query heads, 4 KV heads, D 64,
blocks of 16, block ids shuffled), float32 cache, K/V reused across calls (so this measures the
kernel's arithmetic and walk, not DRAM). Prints the median microseconds per call of each build and
their ratio, and checks that both give the same outputs to float32 rounding.
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from pdcluster.kernels import native, paged_decode_cpu

SRC = "kernels/csrc/paged_decode_cpu.c"
CASES = ((1, 256), (1, 2048), (8, 512), (16, 1024), (32, 300))


def build(source: str, header: str, out_dir: pathlib.Path, name: str) -> ctypes._CFuncPtr:
    """pd_paged_decode from `source` (with `header` as cpu_math.h), built with native.py's flags."""
    d = out_dir / name
    d.mkdir()
    (d / "paged_decode_cpu.c").write_text(source)
    (d / "cpu_math.h").write_text(header)
    lib = d / "lib.so"
    subprocess.run([native._compiler(), *native.CFLAGS, "-o", str(lib), str(d / "paged_decode_cpu.c")], check=True)
    return paged_decode_cpu.declare(ctypes.CDLL(str(lib)))


def git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="HEAD", help="the git revision to compare the working tree against")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--calls", type=int, default=300, help="calls of each build per case")
    args = parser.parse_args()
    root = pathlib.Path(__file__).resolve().parents[1]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pd-ab-"))
    try:
        libs = {
            args.rev: build(git_show(args.rev, SRC), git_show(args.rev, "kernels/csrc/cpu_math.h"), tmp, "rev"),
            "now": build((root / SRC).read_text(), (root / "kernels/csrc/cpu_math.h").read_text(), tmp, "now"),
        }
        hq, hk, d, bs = 12, 4, 64, 16
        g = torch.Generator().manual_seed(0)
        print(f"threads={args.threads} heads {hq}/{hk} D={d} block {bs}, float32 cache; median us per call")
        for batch, ctx in CASES:
            nb = -(-ctx // bs)
            blocks = nb * batch + 4
            k = torch.randn(blocks, bs, hk, d, generator=g)
            v = torch.randn(blocks, bs, hk, d, generator=g)
            tables = torch.randperm(blocks, generator=g)[: nb * batch].to(torch.int32).view(batch, nb)
            q = torch.randn(batch, hq, d, generator=g)
            lens = torch.randint(max(1, ctx // 2), ctx + 1, (batch,), generator=g)
            outs = {name: torch.empty(batch, hq, d) for name in libs}
            times: dict[str, list[float]] = {name: [] for name in libs}
            for _ in range(args.calls):
                for name, fn in libs.items():
                    t0 = time.perf_counter()
                    rc = fn(q.data_ptr(), outs[name].data_ptr(), k.data_ptr(), v.data_ptr(), 0,
                            tables.data_ptr(), nb, lens.data_ptr(), batch, hq, hk, d, bs, 0, d ** -0.5,
                            args.threads)
                    times[name].append(time.perf_counter() - t0)
                    assert rc == 0, rc
            torch.testing.assert_close(outs["now"], outs[args.rev], atol=2e-6, rtol=2e-6)
            before, now = (1e6 * statistics.median(times[n]) for n in (args.rev, "now"))
            print(f"batch {batch:>2} context <= {ctx:>4}: {args.rev} {before:8.1f}  now {now:8.1f}  "
                  f"-> {before / now:.2f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
