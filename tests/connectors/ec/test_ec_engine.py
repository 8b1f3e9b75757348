"""Encoder outputs over the p2p_ec connector between real engines (tiny random LLaVA, float32):
token-exact vs transformers whether the embeddings come over EC (shared memory or TCP) or are
computed locally; a prefill engine announcing what it encoded; an item evicted after its announce;
a producer process killed mid-request; encoder-only engines; no leaks after shutdown."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import collect, run
from models.llava_tiny import hf_greedy, random_image
from proc_sockets import listening

from pdcluster import SamplingParams
from pdcluster.engine.ec_transfer_params import ECItemRef, ECTransferParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PRODUCER_PROC = os.path.join(os.path.dirname(__file__), "ec_producer_proc.py")


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def ec_stats(engine) -> dict:
    return engine.get_stats()["ec_connector"]


@pytest.fixture(scope="module")
def trio(llava_path, ec_keys):
    """E: encoder-only producer; P: full engine, producer + consumer (shm); C: consumer over TCP."""
    from pdcluster import AsyncEngine
    from pdcluster.config import EngineArgs
    from pdcluster.connectors import ec_connector_factory

    def make(name: str, **kw):
        opts = ec_keys.options(name, **kw.pop("opts"))
        args = EngineArgs(model=llava_path, device="cpu", block_size=4, num_kv_blocks=64, ec_connector="p2p_ec",
                          ec_connector_options=opts, **kw)
        return AsyncEngine.from_engine_args(args, ec_connector=ec_connector_factory)

    engines = {}
    try:
        engines["E"] = make("encoder", encoder_only=True, opts={"role": "producer"})
        engines["P"] = make("prefill", opts={"role": "both"})
        engines["C"] = make("other", opts={"role": "consumer", "transport": "tcp", "request_timeout_s": 1.0})
        yield engines
    finally:
        for e in engines.values():
            e.shutdown()


def test_encoder_only_engine_has_no_decoder(trio) -> None:
    runner = trio["E"].engine.core.runner
    names = [n for n, _ in runner.model.named_parameters()]
    assert names and all(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in names)
    assert not hasattr(runner, "kv_caches")
    with pytest.raises(ValueError, match="encoder_only"):
        run(collect(trio["E"], "t1 <image>", [random_image(1)], GREEDY))
    assert trio["E"].ec_endpoint()[0] == trio["E"].engine.ec.connector.server.address
    assert trio["C"].ec_endpoint() is None  # a pure consumer announces nothing


@pytest.mark.parametrize("consumer", ["P", "C"])  # shared memory, TCP
def test_embeddings_over_ec_token_exact(trio, llava_path, consumer) -> None:
    e, c = trio["E"], trio[consumer]
    seed = 100 if consumer == "P" else 200
    fetched, local = random_image(seed), random_image(seed + 1, 40, 52)
    params = run(e.encode(f"enc-{consumer}", [png(fetched), png(fetched)]))  # one item per distinct image
    assert len(params.items) == 1 and params.items[0].lease_id and params.items[0].num_tokens == 16
    before = dict(ec_stats(c))
    prompt = "t3 <image> t4 <image> t5"
    tokens, final = run(collect(c, prompt, [png(fetched), png(local)], GREEDY, ec=(params,)))
    after = ec_stats(c)
    assert after["mm_items_remote"] - before["mm_items_remote"] == 1  # the encoder's image came over EC
    assert after["mm_items_computed"] - before["mm_items_computed"] == 1  # the other was encoded here
    assert after["transfer_bytes"] > before["transfer_bytes"]
    assert tokens == hf_greedy(llava_path, prompt, [fetched, local], GREEDY.max_tokens)
    assert ec_stats(e)["mm_items_computed"] >= 1
    held = final.ec_transfer_params  # P produces too: it now holds both images for the next instance
    if consumer == "P":
        assert held is not None and {i.mm_hash for i in held.items} == {f.mm_hash for f in
                                                                        c.engine.prepare_encode([png(fetched),
                                                                                                 png(local)])}
    else:
        assert held is None


def test_prefill_engine_announces_what_it_encoded(trio) -> None:
    p, c = trio["P"], trio["C"]
    image = random_image(300)
    prompt = "t7 <image> t8"
    tokens_p, final = run(collect(p, prompt, [png(image)], GREEDY))
    params = final.ec_transfer_params
    assert params is not None and [i.num_tokens for i in params.items] == [16]
    assert params.address == p.ec_endpoint()[0]
    before = ec_stats(c)["mm_items_remote"]
    tokens_c, final_c = run(collect(c, prompt, [png(image)], GREEDY, ec=(params,)))
    assert tokens_c == tokens_p and ec_stats(c)["mm_items_remote"] == before + 1
    assert final_c.ec_transfer_params is None  # C only consumes
    # the same image again: C's own encoder cache has it, so nothing is fetched and nothing encoded
    stats = dict(ec_stats(c))
    again, _ = run(collect(c, "t9 <image> t8", [png(image)], GREEDY, ec=(params,)))
    after = ec_stats(c)
    assert after["mm_items_local_cache"] == stats["mm_items_local_cache"] + 1
    assert (after["mm_items_remote"], after["transfer_bytes"], after["mm_items_computed"]) == \
        (stats["mm_items_remote"], stats["transfer_bytes"], stats["mm_items_computed"])


def test_item_evicted_after_announce_is_recomputed_locally(trio) -> None:
    e, c = trio["E"], trio["C"]
    image = random_image(400)
    params = run(e.encode("enc-evict", [png(image)]))
    assert e.engine.ec.connector.producer.store.drop(params.items[0].mm_hash)
    before = dict(ec_stats(c))
    tokens, _ = run(collect(c, "t1 <image> t2", [png(image)], GREEDY, ec=(params,)))
    after = ec_stats(c)
    assert after.get("errors_evicted", 0) == before.get("errors_evicted", 0) + 1
    assert after["mm_items_computed"] == before["mm_items_computed"] + 1
    reference, _ = run(collect(trio["P"], "t1 <image> t2", [png(image)], GREEDY))
    assert tokens == reference


def test_producer_killed_mid_request_encodes_locally(trio, ec_keys) -> None:
    c, p = trio["C"], trio["P"]
    image = random_image(500)
    [feature] = c.engine.prepare_encode([png(image)])
    proc = subprocess.Popen([sys.executable, PRODUCER_PROC], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        spec = {"options": ec_keys.options("encoder", role="producer"),
                "fingerprint": c.engine.ec.connector.fingerprint, "mm_hash": feature.mm_hash}
        proc.stdin.write(json.dumps(spec) + "\n")
        proc.stdin.flush()
        endpoint = json.loads(proc.stdout.readline())
        params = ECTransferParams(connector="p2p_ec", address=endpoint["address"],
                                  public_key=endpoint["public_key"].encode(), items=(ECItemRef(feature.mm_hash),))
        fetcher = c.engine.ec.connector.fetcher
        retries, timeouts = fetcher.stats().get("not_ready_retries", 0), fetcher.stats().get("errors_timeout", 0)
        result = {}
        t = threading.Thread(target=lambda: result.update(
            r=run(collect(c, "t2 <image> t3", [png(image)], GREEDY, ec=(params,)))))
        t.start()
        end = time.monotonic() + 60
        while fetcher.stats().get("not_ready_retries", 0) <= retries:  # the fetch is in flight
            assert time.monotonic() < end, "the consumer never reached the producer"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        t.join(120)
        reference, _ = run(collect(p, "t2 <image> t3", [png(image)], GREEDY))
        assert result["r"][0] == reference  # that request still answered, encoded locally
        assert fetcher.stats()["errors_timeout"] == timeouts + 1
        again, _ = run(collect(c, "t2 <image> t3", [png(image)], GREEDY, ec=(params,)))  # the next one works
        assert again == reference and c.is_healthy
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_encode_needs_an_ec_producer(engines, llava_path) -> None:
    plain = engines(llava_path)
    with pytest.raises(ValueError, match="no EC connector"):
        run(plain.encode("x", [png(random_image(1))]))
    with pytest.raises(ValueError, match="ec_connector_options given without"):
        engines(llava_path, ec_connector_options={"port": 0})


def test_nothing_leaks_after_engine_shutdown(engines, llava_path, ec_keys) -> None:
    before = {t.ident for t in threading.enumerate()}
    e = engines(llava_path, encoder_only=True, ec_connector="p2p_ec",
                ec_connector_options=ec_keys.options("encoder", role="both", transport="tcp"))
    params = run(e.encode("leak", [png(random_image(9))]))
    conn = e.engine.ec.connector
    shm = f"/dev/shm/{conn.producer.region.shm_name}"
    ports = {int(params.address.rpartition(":")[2]), conn.producer.server.address[1]}
    assert os.path.exists(shm) and ports <= {port for _, port in listening([os.getpid()])}
    e.shutdown()
    assert not os.path.exists(shm)
    assert not ports & {port for _, port in listening([os.getpid()])}
    end = time.monotonic() + 30
    while {t.ident for t in threading.enumerate()} - before:
        assert time.monotonic() < end, [t.name for t in threading.enumerate() if t.ident not in before]
        time.sleep(0.01)
