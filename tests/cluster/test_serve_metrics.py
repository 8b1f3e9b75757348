"""`pdcluster serve --prefill 1 --decode 1 --connector p2p`: the ready line lists every instance
with its metrics URL; after one disaggregated request each instance's /metrics shows the KV it
moved (the decode worker loaded bytes, the prefill worker served them), and every metrics
endpoint listens on loopback only."""

from __future__ import annotations

import json
import time
import urllib.request

from proc_sockets import listening
from prometheus_client.parser import text_string_to_metric_families
from serve_procs import start_serve, stop_serve

from pdcluster import SamplingParams
from pdcluster.client import Client

# Whose counter shows the transfer: the consumer counts what it loaded, the producer what peers
# read from it (TCP: over shared memory the producer is not involved in the copy).
BYTES = {"decode": ("pdcluster_connector_loaded_bytes_total", {"transport": "tcp"}),
         "prefill": ("pdcluster_connector_served_bytes_total", {})}


def _sample(url: str, name: str, labels: dict[str, str]) -> float:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_instance_serves_metrics_with_connector_bytes(tmp_path) -> None:
    from pdcluster.models.demo import ensure_demo_model

    model = str(ensure_demo_model(tmp_path / "model"))
    opts = json.dumps({"transport": "tcp"})
    proc, ready = start_serve(["--model", model, "--prefill", "1", "--decode", "1", "--policy", "round_robin",
                               "--connector", "p2p", "--worker-args", f"--max-model-len 256 --kv-connector-options '{opts}'"])
    try:
        instances = ready["instances"]
        assert sorted(instances) == ["decode-0", "prefill-0"]
        for name, inst in instances.items():
            assert inst["role"] == name.split("-")[0] and inst["address"] in ready["workers"]
            assert inst["metrics"].startswith("http://127.0.0.1:") and inst["metrics"].endswith("/metrics")
            port = int(inst["metrics"].rsplit(":", 1)[1].split("/")[0])
            bound = [addr for (addr, p) in listening([inst["pid"]]) if p == port]
            assert bound == ["127.0.0.1"], f"{name}: metrics port {port} bound on {bound}"
            role = inst["role"]
            assert _sample(inst["metrics"], "pdcluster_worker_info", {"role": role, "connector": "p2p"}) == 1
        with Client(ready["grpc"], timeout=120) as client:
            out = client.generate(list(range(5, 45)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert len(out.token_ids) == 8
        for name, inst in instances.items():
            metric, labels = BYTES[inst["role"]]
            # The engine's stats snapshot (and with it the connector's counters) is refreshed by
            # engine steps: the producer's comes with the step that sees the consumer's release.
            deadline = time.monotonic() + 60
            while _sample(inst["metrics"], metric, labels) <= 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _sample(inst["metrics"], metric, labels) > 0, f"{name}: {metric}{labels} is still 0"
        decode = instances["decode-0"]["metrics"]
        assert _sample(decode, "pdcluster_connector_loads_total", {"result": "ok"}) >= 1
        assert _sample(decode, "pdcluster_engine_generation_tokens_total", {}) >= 7
    finally:
        stop_serve(proc)
