"""The environment vLLM's CPU build runs best in, shared by the benchmarks that start it.

vLLM's CPU installation guide asks for tcmalloc and Intel's OpenMP runtime in LD_PRELOAD (its
worker warns "libtcmalloc is not found in LD_PRELOAD ... For best performance" without them), so
a side-by-side that left them out would measure vLLM below its documented set-up. Each library is
preloaded when it is found: tcmalloc from the system (Debian: libtcmalloc-minimal4), libiomp5 from
the vLLM venv (its intel-openmp dependency). What was found is printed with every result.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import tempfile

_TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
             "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def preload_libraries(vllm_python: str) -> list[str]:
    """tcmalloc and libiomp5 for vLLM's processes, those that exist (possibly none)."""
    found = [p for p in _TCMALLOC if os.path.exists(p)][:1]
    # Not resolved: a venv's bin/python is a link to the base interpreter, outside the venv.
    iomp = pathlib.Path(vllm_python).absolute().parent.parent / "lib" / "libiomp5.so"
    return found + ([str(iomp)] if iomp.exists() else [])


def vllm_env(vllm_python: str, base: dict[str, str] | None = None, preload: bool = True) -> dict[str, str]:
    """`base` (default: os.environ) with vLLM's recommended LD_PRELOAD prepended (preload=True)."""
    env = dict(os.environ if base is None else base)
    libs = preload_libraries(vllm_python) if preload else []
    if libs:
        env["LD_PRELOAD"] = ":".join(libs + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    return env


def run_vllm_offline(vllm_python: str, model: str, workload: dict) -> dict:
    """_vllm_throughput.py's result for `workload` (its docstring lists the keys) in vLLM's venv,
    with its preload: {"times": [...], "generated": n, and "tokens" when asked}."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload, f)
    script = pathlib.Path(__file__).resolve().parent / "_vllm_throughput.py"
    env = dict(vllm_env(vllm_python), VLLM_CPU_KVCACHE_SPACE="2", VLLM_LOGGING_LEVEL="WARNING", HF_HUB_OFFLINE="1")
    # -P: keep benchmarks/ off sys.path (vLLM imports a top-level `kernels` module of its own).
    try:
        proc = subprocess.run([vllm_python, "-P", str(script), model, f.name], capture_output=True, text=True, env=env)
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"vLLM run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
