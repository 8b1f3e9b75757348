"""The issue's scenario by hand (not a test; the tests are tests/router/test_migration*.py):
`pdcluster serve --prefill 1 --decode 2 --connector p2p`, N greedy streams of T tokens, one decode
worker SIGKILLed once every stream has a few tokens. Prints one RESULTS.md row: requests sent,
right text (equal to the offline engine), clear error, lost, leaks (KV blocks still used on the
surviving workers, processes left after stop), migrations counted by the router.

    .venv/bin/python tests/chaos/kill_decode_demo.py [--streams 4] [--tokens 400]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: serve_procs

import grpc  # noqa: E402
from serve_procs import descendants, start_serve, stop_serve  # noqa: E402

from pdcluster._proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--kill-after", type=int, default=5, help="tokens every stream has before the kill")
    args = ap.parse_args()
    from pdcluster import LLM, SamplingParams
    from pdcluster.models.demo import ensure_demo_model

    model = str(ensure_demo_model(pathlib.Path(tempfile.mkdtemp()) / "model"))
    prompts = [[5 + i, 17, 29 + i, 3] for i in range(args.streams)]
    offline = LLM(model, max_model_len=512)
    want = [list(o.outputs[0].token_ids) for o in offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))]
    proc, ready = start_serve(["--model", model, "--prefill", "1", "--decode", "2", "--connector", "p2p",
                               "--policy", "round_robin", "--insecure-internal",  # Stats below is asked in plaintext
                               "--worker-args", "--max-model-len 512"])
    got: list[list[int]] = [[] for _ in prompts]
    ends: list[str] = ["lost"] * len(prompts)
    try:
        channel = grpc.insecure_channel(ready["grpc"])
        stub = router_pb2_grpc.RouterStub(channel)

        def run(i: int) -> None:
            try:
                for r in stub.Generate(router_pb2.GenerateRequest(
                        prompt_token_ids=router_pb2.TokenIds(ids=prompts[i]), stream=True,
                        sampling_params=common_pb2.SamplingParams(max_tokens=args.tokens, temperature=0,
                                                                  ignore_eos=True)), timeout=300):
                    got[i] += r.token_ids
                    if r.finished:
                        ok = r.finish_reason == common_pb2.FINISH_REASON_LENGTH and got[i] == want[i]
                        ends[i] = "right" if ok else ("error" if r.error_message else "wrong")
            except grpc.RpcError as e:
                ends[i] = "error" if e.details() else "lost"

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        while min(len(g) for g in got) < args.kill_after and time.monotonic() - t0 < 120:
            time.sleep(0.005)
        victim = next(v for k, v in sorted(ready["instances"].items()) if v["role"] == "decode")
        unfinished = sum(len(g) < args.tokens for g in got)
        os.kill(victim["pid"], signal.SIGKILL)
        for t in threads:
            t.join(300)
        metrics = urllib.request.urlopen(ready["http"] + "/metrics", timeout=10).read().decode()
        migrations = sum(float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith("pdcluster_router_migrations_total{"))
        used = 0
        for v in ready["instances"].values():
            if v["pid"] == victim["pid"]:
                continue
            with grpc.insecure_channel(v["address"]) as ch:
                for _ in range(100):  # the producer's lease ends once the consumer is done
                    used = worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10).num_kv_blocks_used
                    if used == 0:
                        break
                    time.sleep(0.1)
        channel.close()
    finally:
        tree = descendants(proc.pid)
        stop_serve(proc)
    left = sum(os.path.exists(f"/proc/{pid}") for pid in tree)  # every process serve started is gone
    print(f"| SIGKILL decode worker | {len(prompts)} | {ends.count('right')} | {ends.count('error')} | "
          f"{ends.count('lost') + ends.count('wrong')} | blocks {used}, procs {left} | migrations {migrations:g} "
          f"(streams unfinished at the kill: {unfinished}) |")
    return 0 if ends.count("right") == len(prompts) and not used and not left else 1


if __name__ == "__main__":
    sys.exit(main())
