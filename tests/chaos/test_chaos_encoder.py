"""Encoder-role chaos on the tiny random LLaVA (made by transformers at test time), an in-process
router and multimodal chat requests, in two layouts: encode-0 + both-0 (aggregated), and encode-0
+ prefill-0 + decode-0 (P2P KV hand-off; prefill-0 fetches the encoder's outputs, the decode leg
gets the images only). "The worker" below is both-0 or prefill-0.

Faults: SIGKILL / SIGSTOP of the encoder while it is inside the request's Encode (ec_hold_cli.py
holds every Encode while a file exists, so the signal lands mid-request however fast the machine
is), and a FaultProxy (reset / blackhole / corrupt) on the EC control port and on the EC data plane
between the encoder and the worker. The encoder announces 127.0.0.2:PORT for both (the connector's
advertise_host; the data address through the CLI hook) and the proxies listen there, forwarding to
its real 127.0.0.1 ports; the worker reads over TCP (transport "tcp"), so every byte of the EC
planes crosses a proxy.

For each: the request answers with the offline text (the worker encodes locally: the router keeps
the media) or a clear error, by its deadline; the fault shows in the router's
pdcluster_router_ec_encodes_total{result} or the worker's pdcluster_ec_errors_total{reason};
afterwards nothing runs on any worker (Stats, KV leases), the test process has no new thread or
listener, and a killed encoder leaves no process and (once a new one started: it reaps segments
nobody holds) no /dev/shm segment. All rows are slow (each layout's workers start in ~20-60 s)."""

from __future__ import annotations

import base64
import io
import itertools
import json
import pathlib
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from chaos.ec_hold_cli import DATA_ENV, HOLD_ENV
from chaos.fault_proxy import FaultProxy
from chaos.leaks import ResultRow, leftover_processes, shm_segments
from chaos.router_worker_rig import Rig, close_rig, make_rig
from models.llava_tiny import make_tiny_llava, random_image
from prometheus_client.parser import text_string_to_metric_families
from real_router_cluster import WorkerProc, wait_until

pytestmark = pytest.mark.slow

EC_HOLD_CLI = pathlib.Path(__file__).resolve().parent / "ec_hold_cli.py"
LOOP2 = "127.0.0.2"  # where the encoder says its EC planes are: the proxies
MAX_NEW = 6
ENCODE_TIMEOUT_S = 3.0  # the router's bound on one Encode (a stopped encoder costs this)
WORKER_ARGS = ["--max-model-len", "256", "--num-kv-blocks", "64", "--block-size", "4", "--log-level", "WARNING"]
# The consumer's EC bounds: a silent producer costs a fetch about this long, then local encode.
CONSUMER_EC = {"transport": "tcp", "request_timeout_s": 1.0, "fetch_timeout_s": 2.0, "io_timeout_s": 2.0}
_seeds = itertools.count(100)
# As tests/cluster/test_serve_epd.py has them (that module is not importable from here: `cluster`
# is the product's package): the chat template and what it renders for one image + "t5 t6".
PROMPT = "USER: <image>\nt5 t6 ASSISTANT:"
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


class EcHoldWorker(WorkerProc):
    cli = EC_HOLD_CLI


@dataclass
class Ec:
    encoder: WorkerProc
    worker: WorkerProc
    control: FaultProxy
    data: FaultProxy
    hold: pathlib.Path
    workers: list[WorkerProc]  # every worker but the encoder; `worker` (the first) fetches its outputs
    layout: str

    def follow_data_port(self) -> None:
        """Point the data proxy at the port the (re)started encoder's TransferServer bound."""
        self.data.upstream = ("127.0.0.1", int((self.hold / "data-port").read_text()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = make_tiny_llava(tmp_path_factory.mktemp("llava") / "ckpt", seed=1)
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write(LLAVA_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def offline(ckpt: str) -> Iterator[Callable[[Any], str]]:
    from pdcluster import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    llm = LLM(ckpt, num_kv_blocks=64, block_size=4)
    try:
        yield lambda image: llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}],
                                         greedy)[0].outputs[0].text
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", params=["aggregated", "disagg"])
def ec(request: pytest.FixtureRequest, ckpt: str, key_dir: pathlib.Path,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ec]:
    """encode-0 + both-0 (aggregated), or encode-0 + prefill-0 + decode-0 (P2P KV hand-off): the
    worker that fetches the encoder's outputs is both-0 or prefill-0 (a decode leg after a KV
    hand-off gets the images only)."""
    hold = tmp_path_factory.mktemp("ec-hold")
    logs = tmp_path_factory.mktemp("ec-logs")
    cport, dport = _free_port(), _free_port()
    common = ["--model", ckpt, *WORKER_ARGS, "--key-dir", str(key_dir), "--ec-connector", "p2p_ec"]
    encoder = EcHoldWorker("encode-0", ["--role", "encode", *common, "--ec-connector-options", json.dumps(
        {"port": cport, "advertise_host": LOOP2, "lease_s": 5.0})], logs,
        env={HOLD_ENV: str(hold), DATA_ENV: f"{LOOP2}:{dport}"})
    ec_args = ["--ec-connector-options", json.dumps(CONSUMER_EC)]
    if request.param == "aggregated":
        others = [EcHoldWorker("both-0", ["--role", "both", *common, *ec_args], logs)]
    else:
        kv = {"PDCLUSTER_KV_CONNECTOR_OPTIONS": json.dumps({"params_secret": secrets.token_hex(32)})}
        others = [EcHoldWorker(name, ["--role", role, *common, *ec_args, "--kv-connector", "p2p"], logs, env=kv)
                  for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"))]
    everyone = [encoder, *others]
    pids: list[int] = []
    proxies: list[FaultProxy] = []
    try:
        for w in everyone:
            w.wait_ready(180)
        proxies = [FaultProxy(("127.0.0.1", cport), port=cport, host=LOOP2),
                   FaultProxy(("127.0.0.1", 1), port=dport, host=LOOP2)]
        state = Ec(encoder, others[0], *proxies, hold, others, request.param)
        state.follow_data_port()
        yield state
    finally:
        for p in proxies:
            p.close()
        pids = [w.pid for w in everyone if w.proc is not None]
        for w in everyone:
            w.stop()
    assert leftover_processes(pids) == []
    assert shm_segments(pids) == []


@pytest.fixture
def rig(loop_thread, ec: Ec, ckpt: str, key_dir: pathlib.Path) -> Iterator[Rig]:
    for w in (ec.encoder, *ec.workers):  # a SIGKILLed encoder was restarted by its row
        w.wait_ready(180)
    rig = make_rig(loop_thread, [ec.encoder, *ec.workers], ckpt, encode_timeout_s=ENCODE_TIMEOUT_S,
                   stall_timeout_s=60.0, key_dir=str(key_dir))
    try:
        yield rig
    finally:
        left = close_rig(rig)
        assert left == [], left


def _chat(rig: Rig, image: Any) -> str:
    import openai

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    client = openai.OpenAI(base_url=rig.cluster.http_url + "/v1", api_key="unused", timeout=120, max_retries=0)
    out = client.chat.completions.create(
        model="ckpt", max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "t5 t6"}]}])
    return out.choices[0].message.content


def _by_label(text: str, name: str, label: str) -> dict[str, float]:
    return {s.labels.get(label, ""): s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def _counters(rig: Rig, ec: Ec) -> dict[str, float]:
    import urllib.request

    out = {f"router ec_encodes {k}": v for k, v in
           _by_label(rig.cluster.metrics_text(), "pdcluster_router_ec_encodes_total", "result").items()}
    text = urllib.request.urlopen(ec.worker.ready["metrics"], timeout=10).read().decode()
    who = ec.worker.name
    out.update({f"{who} ec_errors {k}": v for k, v in _by_label(text, "pdcluster_ec_errors_total", "reason").items()})
    out.update({f"{who} mm_items {k}": v for k, v in _by_label(text, "pdcluster_mm_items_total", "source").items()})
    return out


def _started(ec: Ec) -> set[str]:
    return {p.name for p in ec.hold.glob("started-*")}


HELD = {"SIGKILL mid-Encode": signal.SIGKILL, "SIGSTOP mid-Encode": signal.SIGSTOP}
PLANE: dict[str, tuple[str, Callable[[FaultProxy], None]]] = {
    "reset (RST)": ("EC control port", lambda p: p.reset()),
    "blackhole": ("EC control port", lambda p: p.blackhole()),
    "corrupt producer->consumer": ("EC control port", lambda p: p.corrupt("down", 0)),
    "reset (RST), data": ("EC data plane", lambda p: p.reset()),
    "blackhole, data": ("EC data plane", lambda p: p.blackhole()),
    "corrupt producer->consumer, data": ("EC data plane", lambda p: p.corrupt("down", 64)),
}


def _case(rig: Rig, ec: Ec, offline, chaos_rows: list[ResultRow], name: str) -> None:
    image = random_image(next(_seeds))  # a new image: no encoder cache anywhere has it
    want = offline(image)
    before = _counters(rig, ec)
    killed: list[int] = []
    sig = HELD.get(name)
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        if sig is not None:
            seen = _started(ec)
            (ec.hold / "hold").touch()
            answer = pool.submit(_chat, rig, image)
            assert wait_until(lambda: _started(ec) - seen, 60, 0.01), "the Encode never reached the encoder"
            t0 = time.monotonic()
            if sig == signal.SIGKILL:
                killed.append(ec.encoder.pid)
                ec.encoder.kill()
            else:
                ec.encoder.pause()
            role = "encode worker"
        else:
            role, arm = PLANE[name]
            arm(ec.control if role == "EC control port" else ec.data)
            answer = pool.submit(_chat, rig, image)
        try:
            got, error = answer.result(150), ""
        except Exception as e:  # noqa: BLE001 - classified below
            got, error = None, f"{type(e).__name__}: {e}"
    recover = time.monotonic() - t0
    # Undo: proxies forward again, the encoder runs again (a killed one restarts and reaps its segment).
    for p in (ec.control, ec.data):
        p.clear()
    (ec.hold / "hold").unlink(missing_ok=True)
    ec.encoder.resume()
    orphans = shm_segments(killed)
    if killed:
        ec.encoder.restart(180)
        ec.follow_data_port()
        # Its new stdout reader belongs to the module's WorkerProc, not to this row.
        rig.baseline.threads |= {t.ident for t in threading.enumerate() if t.name == f"{ec.encoder.name}-stdout"}
        assert rig.cluster.wait_healthy(1 + len(ec.workers), 60), "the restarted encoder never came back"
    leaks = rig.leaks() + [f"process {p}" for p in leftover_processes(killed)]
    leaks += [f"shm {s}" for s in shm_segments(killed)]
    after = _counters(rig, ec)
    moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    faulty = {k: v for k, v in moved.items() if "ec_errors" in k or ("ec_encodes" in k and not k.endswith(" ok"))}
    end = "right" if got == want else ("error" if error and "Error" in error else "lost")
    shown = ", ".join(f"{k} +{v:g}" for k, v in sorted(moved.items())) or "no counter moved"
    if orphans:
        shown += f"; killed encoder's shm segments {len(orphans)} until the restarted encoder reaped them"
    role += "" if ec.layout == "aggregated" else " (E->P, P/D)"
    chaos_rows.append(ResultRow(name.removesuffix(", data"), role, 1, end == "right", end == "error", end == "lost",
                                leaks, recover, shown + (f"; {error[:150]}" if error else ""),
                                command="PDCLUSTER_CHAOS_TABLE=/tmp/chaos.md .venv/bin/python -m pytest -m slow "
                                        "tests/chaos/test_chaos_encoder.py"))
    assert end in ("right", "error"), (got, want, error)
    assert end == "right", error  # the media stays with the request: a failed E step is a local encode
    assert leaks == [], leaks
    assert faulty, moved  # the fault shows in a counter


@pytest.mark.parametrize("name", [*HELD, *PLANE])
def test_encoder_fault_matrix(rig, ec, offline, chaos_rows, name):
    _case(rig, ec, offline, chaos_rows, name)


def test_no_fault_fetches_through_both_proxies(rig, ec, offline):
    """The set-up itself: with no fault the worker fetches the encoder's output over the proxies."""
    image = random_image(next(_seeds))
    before = _counters(rig, ec)
    assert _chat(rig, image) == offline(image)
    after: dict[str, float] = {}

    def fetched() -> bool:  # engine counters are as of its last step
        after.update(_counters(rig, ec))
        key = f"{ec.worker.name} mm_items remote"
        return after.get(key, 0) - before.get(key, 0) >= 1

    assert wait_until(fetched, 20, 0.1), after
    assert after.get("router ec_encodes ok", 0) - before.get("router ec_encodes ok", 0) == 1
    assert ec.control.snapshot()["forwarded"]["down"] > 0 and ec.data.snapshot()["forwarded"]["down"] > 0
