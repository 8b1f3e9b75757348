"""CPU pinning: CPU lists, the partition between workers, and a real process pinned by $PDCLUSTER_CPUS."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdcluster.cluster.cpu_pinning import ENV_CPUS, apply_from_env, format_cpu_list, parse_cpu_list, partition


@pytest.mark.parametrize("text, cpus", [("0", (0,)), ("0-3,6", (0, 1, 2, 3, 6)), (" 3 , 1-2 ", (1, 2, 3)),
                                        ("2,2,1-2", (1, 2))])
def test_parse_and_format(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus
    assert format_cpu_list((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "0-", "1,,2", "99999999"])
def test_bad_lists_name_the_variable(text):
    with pytest.raises(ValueError, match=ENV_CPUS):
        parse_cpu_list(text)


def test_partition_gives_disjoint_slices_sized_by_tp():
    assert partition([0, 1], [1, 1]) == [(0,), (1,)]
    assert partition([0, 1, 2, 3], [1, 1]) == [(0, 1), (2, 3)]
    assert partition([0, 1, 2, 3, 4], [2, 1]) == [(0, 1, 2), (3, 4)]
    assert partition([4, 0, 2], [1, 1, 1]) == [(0,), (2,), (4,)]
    with pytest.raises(ValueError, match="need 3 cores.*only 2"):
        partition([0, 1], [2, 1])
    with pytest.raises(ValueError, match="at least one core"):
        partition([0, 1], [0, 1])


def test_a_real_process_is_pinned_and_torch_follows_the_mask():
    cpu = min(os.sched_getaffinity(0))
    code = ("import json, os\nfrom pdcluster.cluster.cpu_pinning import apply_from_env\n"
            "pinned = apply_from_env()\nimport torch\n"
            "print(json.dumps([list(pinned), sorted(os.sched_getaffinity(0)), torch.get_num_threads()]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, ENV_CPUS: str(cpu)},
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[cpu], [cpu], 1]


def test_unavailable_cpus_are_refused_by_name():
    assert apply_from_env({}) is None
    with pytest.raises(ValueError, match=rf"{ENV_CPUS}=65000: CPUs 65000 are not available"):
        apply_from_env({ENV_CPUS: "65000"})


def test_serve_pin_cpus_refuses_more_workers_than_cores_by_name():
    """`serve --pin-cpus` with more TP ranks than this process's CPUs stops before any worker starts."""
    cores = len(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--model", "/nonexistent",
                          "--workers", str(cores + 1), "--pin-cpus", "--grpc-port", "0", "--http-port", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"--pin-cpus: {cores + 1} workers need {cores + 1} cores" in out.stderr


def _allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list"))


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_serve_pin_cpus_gives_prefill_and_decode_cores_of_their_own(tmp_path):
    from serve_procs import start_serve, stop_serve

    from pdcluster import SamplingParams
    from pdcluster.client import Client
    from pdcluster.models.demo import ensure_demo_model

    model = str(ensure_demo_model(tmp_path / "model"))
    proc, ready = start_serve(["--model", model, "--prefill", "1", "--decode", "1", "--connector", "p2p",
                               "--pin-cpus", "--max-model-len", "256"])
    try:
        slices = partition(sorted(os.sched_getaffinity(0)), [1, 1])
        pinned = {name: _allowed(inst["pid"]) for name, inst in ready["instances"].items()}
        assert pinned == {"prefill-0": format_cpu_list(slices[0]), "decode-0": format_cpu_list(slices[1])}
        with Client(ready["grpc"], timeout=120) as client:
            out = client.generate(list(range(5, 45)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert len(out.token_ids) == 8
    finally:
        stop_serve(proc)


def test_threads_per_rank_splits_the_cpus_between_the_ranks():
    from pdcluster.cluster.cpu_pinning import threads_per_rank

    assert threads_per_rank(2, 1) == 2
    assert threads_per_rank(2, 2) == 1  # 1P+1D on two cores: one thread each
    assert threads_per_rank(16, 3) == 5
    assert threads_per_rank(2, 3) == 1  # never zero
    with pytest.raises(ValueError, match="ranks >= 1"):
        threads_per_rank(2, 0)


def test_serve_worker_threads_flag_and_what_the_user_set_wins():
    from pdcluster.cluster.serve_cmd import worker_thread_count

    assert worker_thread_count("auto", [1, 1], 2, environ={}) == 1
    assert worker_thread_count("auto", [1], 16, environ={}) == 16
    assert worker_thread_count("auto", [2, 1, 1], 16, environ={}) == 4  # per TP rank
    assert worker_thread_count("3", [1, 1], 2, environ={}) == 3
    assert worker_thread_count("0", [1, 1], 2, environ={}) is None  # torch's default
    assert worker_thread_count("auto", [1, 1], 2, environ={"PDCLUSTER_NUM_THREADS": "2"}) is None
    assert worker_thread_count("auto", [1, 1], 2, environ={"OMP_NUM_THREADS": "2"}) is None


def test_serve_refuses_a_bad_worker_threads_value_by_name():
    out = subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--model", "/nonexistent",
                          "--worker-threads", "-1", "--grpc-port", "0", "--http-port", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--worker-threads" in out.stderr and "auto or a number" in out.stderr
