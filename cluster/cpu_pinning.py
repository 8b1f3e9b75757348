"""CPU pinning of the workers on one machine: each worker on cores of its own.

On a CPU host the point of P/D disaggregation (steadier decode under mixed load) only shows when
prefill and decode do not compete for the same cores, so `pdcluster serve --pin-cpus` (and the
pinned sweep) give each worker a disjoint slice of the launcher's CPUs:

    partition([0, 1, 2, 3], [1, 1])  -> [(0, 1), (2, 3)]     two workers, two cores each
    partition([0, 1], [2, 1])        -> ValueError            a TP-2 worker + one more need 3 cores

A worker learns its slice from $PDCLUSTER_CPUS ("0-3,6"), applied by apply_from_env() first thing
in the worker process (before torch starts its thread pool): sched_setaffinity on itself, which TP
rank processes inherit. Torch sizes its thread pool from the affinity mask, and a TP instance
splits the mask's cores between its ranks (distributed/executor.py). Stdlib only: the launcher
imports this.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

ENV_CPUS = "PDCLUSTER_CPUS"
ENV_THREADS = "PDCLUSTER_NUM_THREADS"  # torch threads of each engine process (engine/model_runner.py)
MAX_CPU = 1 << 16
# What a user may have set to size torch's pool themselves: then `serve` leaves it alone.
USER_THREAD_VARS = (ENV_THREADS, "OMP_NUM_THREADS")


def parse_cpu_list(text: str, *, name: str = ENV_CPUS) -> tuple[int, ...]:
    """ "0-3,6" -> (0, 1, 2, 3, 6); ValueError naming `name` for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{name}: {text!r} is not a CPU list like '0-3,6'") from None
        if not 0 <= a <= b < MAX_CPU:
            raise ValueError(f"{name}: range {part!r} must be 0 <= first <= last < {MAX_CPU}")
        cpus.update(range(a, b + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5" (the form /proc and taskset use)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def partition(cpus: Sequence[int], weights: Sequence[int]) -> list[tuple[int, ...]]:
    """Disjoint slices of `cpus`, one per worker, worker i getting at least weights[i] cores (its TP
    size); cores left over go one by one to the workers in order. ValueError when there are fewer
    cores than the workers need together."""
    cpus = sorted(set(cpus))
    if any(w < 1 for w in weights):
        raise ValueError(f"every worker needs at least one core, got weights {list(weights)}")
    need = sum(weights)
    if need > len(cpus):
        raise ValueError(f"--pin-cpus: {len(weights)} workers need {need} cores (one per TP rank), "
                         f"but only {len(cpus)} are available ({format_cpu_list(cpus)})")
    sizes = list(weights)
    for i in range(len(cpus) - need):
        sizes[i % len(sizes)] += 1
    out, start = [], 0
    for size in sizes:
        out.append(tuple(cpus[start:start + size]))
        start += size
    return out


def threads_per_rank(num_cpus: int, ranks: int) -> int:
    """Torch threads for each of `ranks` unpinned engine processes sharing `num_cpus` CPUs: an even
    split, at least one each (what the TP executor already does for the ranks of one instance).

    Why: an OpenMP team of k threads finishes an op only when all k ran it, so two workers' teams of
    every CPU each (1P+1D on one machine) stall each other's ops whenever both run: the ratio of an
    op's time to its work then depends on the scheduler, not the model. threads_per_rank(2, 2) == 1,
    threads_per_rank(16, 3) == 5, threads_per_rank(2, 3) == 1 (more ranks than CPUs: they share)."""
    if num_cpus < 1 or ranks < 1:
        raise ValueError(f"threads_per_rank needs num_cpus >= 1 and ranks >= 1, got {num_cpus}, {ranks}")
    return max(1, num_cpus // ranks)


def apply_from_env(env: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
    """Pin this process to $PDCLUSTER_CPUS (if set): the CPUs pinned to, or None when it is unset. ValueError naming the variable when it asks for
    CPUs this process may not use."""
    env = os.environ if env is None else env
    text = env.get(ENV_CPUS, "").strip()
    if not text:
        return None
    cpus = parse_cpu_list(text)
    allowed = os.sched_getaffinity(0)
    missing = [c for c in cpus if c not in allowed]
    if missing:
        raise ValueError(f"{ENV_CPUS}={text}: CPUs {format_cpu_list(missing)} are not available to this "
                         f"process (allowed: {format_cpu_list(allowed)})")
    os.sched_setaffinity(0, cpus)
    return cpus


__all__ = ["ENV_CPUS", "ENV_THREADS", "USER_THREAD_VARS", "apply_from_env", "format_cpu_list", "parse_cpu_list",
           "partition", "threads_per_rank"]
