"""P2P engine pairs in one process: partial loads after local prefix hits, proof that the loaded
KV is what decodes, a restarted producer (new epoch), and role/params refusals."""

from __future__ import annotations

import random
import socket
import time
from typing import Any

import pytest

from pdcluster.config import EngineArgs
from pdcluster.connectors import engine_connector_factory
from pdcluster.connectors.testing import PREFILL_LEG, assert_idle, decode_leg, run_requests
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _engine(model: str, role: str | None, options: dict[str, Any] | None = None, **extra: Any) -> LLMEngine:
    args = EngineArgs(model=model, num_kv_blocks=96, max_model_len=256, block_size=16,
                      enable_prefix_caching=role is not None, kv_connector="p2p" if role else None,
                      kv_role=role or "both", kv_connector_options=options, **extra)
    return LLMEngine.from_engine_args(args, connector=engine_connector_factory if role else None)


@pytest.fixture(scope="module")
def engines(demo_model: str, cluster_keys: Any) -> Any:
    k = cluster_keys
    made = {"ref": _engine(demo_model, None),
            "producer": _engine(demo_model, "producer", k.options("producer", engine_id="ip-producer", lease_ttl_s=3.0)),
            "consumer": _engine(demo_model, "consumer", k.options("consumer", engine_id="ip-consumer",
                                                                  transport="tcp", open_retry_s=0.3)),
            # A decode worker that holds its running requests' step for a load (kv_load_wait_ms;
            # the hold ends when the load lands, so the bound is only a backstop here).
            "held_consumer": _engine(demo_model, "consumer", k.options("consumer", engine_id="ip-held-consumer",
                                                                       transport="tcp", open_retry_s=0.3),
                                     kv_load_wait_ms=60_000),
            # A decode leg that speculates (n-gram drafts) from the loaded KV on.
            "spec_consumer": _engine(demo_model, "consumer", k.options("consumer", engine_id="ip-spec-consumer",
                                                                       transport="tcp", open_retry_s=0.3),
                                     speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_min": 1, "adaptive": False})}
    yield made
    for e in made.values():
        e.shutdown()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _handoff(producer: LLMEngine, consumer: LLMEngine, rid: str, prompt: list[int],
             before_decode: Any = None, params: SamplingParams = GREEDY) -> tuple[list[int], Any]:
    pre = run_requests(producer, [(rid, prompt, params.replace(max_tokens=1), PREFILL_LEG, None)],
                       [])[rid]
    if before_decode is not None:
        before_decode()
    kv = decode_leg(pre)
    out = run_requests(consumer, [(rid, prompt, params, kv, pre.outputs[0].token_ids)], [producer])[rid]
    out.outputs[0].text = pre.outputs[0].text + out.outputs[0].text  # what a router streams
    return pre.outputs[0].token_ids + out.outputs[0].token_ids, out


def _reference(engines: Any, rid: str, prompt: list[int]) -> list[int]:
    return run_requests(engines["ref"], [(rid, prompt, GREEDY, None, None)], [])[rid].outputs[0].token_ids


def test_partial_load_after_local_prefix_hits(engines: Any) -> None:
    base = _prompt(40, 1)
    longer = base + _prompt(21, 2)
    got, out = _handoff(engines["producer"], engines["consumer"], "base", base)
    ref = run_requests(engines["ref"], [("ref-base", base, GREEDY, None, None)], [])["ref-base"]
    assert got == ref.outputs[0].token_ids
    assert out.outputs[0].text and out.outputs[0].text == ref.outputs[0].text  # t0 is context on the decode leg, never repeated
    before = engines["consumer"].get_stats()
    got, _ = _handoff(engines["producer"], engines["consumer"], "longer", longer)
    after = engines["consumer"].get_stats()
    assert got == _reference(engines, "ref-longer", longer)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 32  # two local blocks of the base prompt
    assert after["external_prefix_hits"] - before["external_prefix_hits"] == len(longer) - 32
    for name in ("producer", "consumer"):
        assert_idle(engines[name], [], name)


def test_speculating_decode_leg_equals_aggregated(engines: Any) -> None:
    """The decode leg checks n-gram drafts from its first step (over the loaded prompt): the whole
    output equals the aggregated engine's, drafts were checked, and both sides end idle."""
    prompt = _prompt(12, 21) * 4  # a repeated phrase gives the drafts something to find
    params = GREEDY.replace(max_tokens=24)
    got, _ = _handoff(engines["producer"], engines["spec_consumer"], "spec-leg", prompt, params=params)
    ref = run_requests(engines["ref"], [("ref-spec-leg", prompt, params, None, None)], [])["ref-spec-leg"]
    assert got == ref.outputs[0].token_ids and len(got) == 24
    assert engines["spec_consumer"].get_stats()["spec_decode_draft_tokens"] > 0
    for name in ("producer", "spec_consumer"):
        assert_idle(engines[name], [], name)


def _tokens_by_request(outs: list[Any]) -> set[str]:
    return {o.request_id for o in outs}


def test_a_held_step_runs_the_loaded_request_with_the_running_one(engines: Any) -> None:
    """kv_load_wait_ms: a decode leg that arrives while a request runs gets a step that only
    starts its load (the running request makes no token in it) and ends when the load landed, so
    the very next step gives both requests a token. Both outputs equal the aggregated engine's."""
    producer, consumer = engines["producer"], engines["held_consumer"]
    params = GREEDY.replace(max_tokens=10)
    bg_prompt, prompt = _prompt(20, 31), _prompt(37, 32)
    consumer.add_prepared(*consumer.prepare_request(bg_prompt, params, "held-bg", None, None))
    for _ in range(3):  # bg's prefill and two decodes
        assert _tokens_by_request(consumer.step()) == {"held-bg"}
    pre = run_requests(producer, [("held", prompt, params.replace(max_tokens=1), PREFILL_LEG, None)], [])["held"]
    producer.step()  # the producer registers the lease in the step after the params left it
    assert producer.get_stats()["kv_connector"]["p2p_leases_active"] == 1
    consumer.add_prepared(*consumer.prepare_request(prompt, params, "held", decode_leg(pre), pre.outputs[0].token_ids))
    assert _tokens_by_request(consumer.step()) == set()  # only the load started; it landed meanwhile
    stats = consumer.get_stats()
    assert stats["num_waiting_for_remote_kv"] == 0 and stats["num_running"] == 1, stats
    assert _tokens_by_request(consumer.step()) == {"held-bg", "held"}  # the loaded leg joins at once
    finals = {}
    while consumer.has_unfinished_requests():
        for out in consumer.step():
            if out.finished:
                finals[out.request_id] = consumer.get_final(out.request_id)
    assert finals["held-bg"].outputs[0].token_ids == run_requests(
        engines["ref"], [("ref-held-bg", bg_prompt, params, None, None)], [])["ref-held-bg"].outputs[0].token_ids
    ref = run_requests(engines["ref"], [("ref-held", prompt, params, None, None)], [])["ref-held"]
    assert pre.outputs[0].token_ids + finals["held"].outputs[0].token_ids == ref.outputs[0].token_ids
    for name in ("producer", "held_consumer"):
        assert_idle(engines[name], [], name)


def test_kv_load_wait_ms_is_checked_by_name(demo_model: str) -> None:
    for bad in (-1, True, "5", 60_001):
        with pytest.raises(ValueError, match=r"kv_load_wait_ms must be a number of milliseconds in \[0, 60000\]"):
            EngineArgs(model=demo_model, kv_load_wait_ms=bad).create_engine_config()
    assert EngineArgs(model=demo_model, kv_load_wait_ms=2.5).create_engine_config().scheduler.kv_load_wait_s == 0.0025


def test_cache_salt_isolates_the_consumers_prefix_cache(engines: Any) -> None:
    """Both legs carry the salt (the router copies sampling params): the producer's hashes, which
    the consumer checks against its own, agree; the consumer's local blocks of a prompt cached
    under one salt are not hits for another salt, which loads the whole prompt instead."""
    base = _prompt(40, 11)
    longer = base + _prompt(21, 12)
    salt_a, salt_b = GREEDY.replace(cache_salt="tenant-a"), GREEDY.replace(cache_salt="tenant-b")
    got, _ = _handoff(engines["producer"], engines["consumer"], "salted-base", base, params=salt_a)
    assert got == _reference(engines, "ref-salted-base", base)
    for params, rid, local in ((salt_b, "salted-b", 0), (GREEDY, "unsalted", 0), (salt_a, "salted-a", 32)):
        before = engines["consumer"].get_stats()
        got, _ = _handoff(engines["producer"], engines["consumer"], rid, longer, params=params)
        after = engines["consumer"].get_stats()
        assert got == _reference(engines, "ref-" + rid, longer)
        assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == local, rid
        assert after["external_prefix_hits"] - before["external_prefix_hits"] == len(longer) - local, rid
    for name in ("producer", "consumer"):
        assert_idle(engines[name], [], name)


def _top_logprobs(out: Any) -> list[dict[int, float]]:
    return [{lp.token_id: lp.logprob for lp in [d.sampled, *d.top]} for d in out.outputs[0].logprobs]


def _max_gap(got: dict[int, float], want: dict[int, float]) -> float:
    """Largest logprob difference over the tokens both top lists hold (inf if none is shared)."""
    shared = got.keys() & want.keys()
    return max((abs(got[t] - want[t]) for t in shared), default=float("inf"))


def test_the_loaded_kv_is_what_decodes(engines: Any) -> None:
    """The consumer decodes from the KV it loaded, not from a recompute of the prompt: with the
    producer's blocks zeroed before the transfer, the first decode step's distribution moves away
    from the reference's, while an untouched transfer reproduces it. Compared on logprobs, not on
    greedy tokens: a trained model may pick the same token from a wrong context."""
    prompt = _prompt(50, 3)
    params = GREEDY.replace(logprobs=5)
    ref = run_requests(engines["ref"], [("ref-kv", prompt, params, None, None)], [])["ref-kv"]
    want = _top_logprobs(ref)[1]  # the reference's second token = the decode leg's first

    def decode_first_step(rid: str, before_decode: Any = None) -> dict[int, float]:
        pre = run_requests(engines["producer"], [(rid, prompt, params.replace(max_tokens=1), PREFILL_LEG, None)],
                           [])[rid]
        if before_decode is not None:
            before_decode()
        out = run_requests(engines["consumer"], [(rid, prompt, params, decode_leg(pre), pre.outputs[0].token_ids)],
                           [engines["producer"]])[rid]
        assert out.error is None and engines["consumer"].get_stats()["external_prefix_hits"] > 0, out
        engines["consumer"].core.scheduler.reset_prefix_cache()  # each leg loads its KV afresh
        return _top_logprobs(out)[0]

    hits = engines["consumer"].get_stats()["external_prefix_hits"]
    assert _max_gap(decode_first_step("kv-intact"), want) < 1e-3  # the control: loaded KV == recompute
    assert engines["consumer"].get_stats()["external_prefix_hits"] - hits == len(prompt)

    def wipe_producer_cache() -> None:  # the blocks are leased: the consumer will read zeros
        engines["producer"].core.runner.kv_caches.zero_()

    wiped = decode_first_step("kv-wiped", wipe_producer_cache)
    assert _max_gap(wiped, want) > 0.05, (wiped, want)
    for name in ("producer", "consumer"):
        assert_idle(engines[name], [], name)
    engines["producer"].core.scheduler.reset_prefix_cache()  # forget the zeroed blocks


def test_idle_steps_wake_when_a_transfer_ends(engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine with only transfers in flight waits in its idle step until the connector says one
    ended (the consumer's loader, the producer's lease), and a step that collected one goes on at
    once. With the idle poll stretched to an hour, a hand-off that relied on the poll would hang
    here; woken, it runs as before, token for token. Each engine steps on its own thread, as in a
    worker process."""
    import threading

    from pdcluster.engine import engine_core

    producer, consumer = engines["producer"], engines["consumer"]
    prompt = _prompt(37, 11)
    want = _reference(engines, "ref-woken", prompt)
    pre = run_requests(producer, [("woken", prompt, GREEDY.replace(max_tokens=1), PREFILL_LEG, None)], [])["woken"]
    monkeypatch.setattr(engine_core, "_IDLE_STEP_S", 3600.0)
    woken = {"producer": 0, "consumer": 0}

    def count(name: str) -> Any:
        core = engines[name].core

        def wake() -> None:
            woken[name] += 1
            core.wake()
        return wake
    for name in woken:
        engines[name].core.runner.connector_hooks.connector.set_wakeup(count(name))
    result: dict[str, Any] = {}

    def run_producer() -> None:  # registers the lease, then waits for its end (the consumer's "done")
        while producer.has_unfinished_requests():
            producer.step()

    def run_consumer() -> None:
        result["out"] = run_requests(consumer, [("woken", prompt, GREEDY, decode_leg(pre), pre.outputs[0].token_ids)],
                                     [])["woken"]
    threads = [threading.Thread(target=f, daemon=True) for f in (run_producer, run_consumer)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120.0)
        assert not any(t.is_alive() for t in threads), "an idle step was not woken when its transfer ended"
    finally:
        for name in woken:
            engines[name].core.runner.connector_hooks.connector.set_wakeup(engines[name].core.wake)
    out = result["out"]
    assert out.error is None and pre.outputs[0].token_ids + out.outputs[0].token_ids == want
    assert woken["consumer"] >= 1 and woken["producer"] >= 1, woken  # the loader's end, the lease's end
    monkeypatch.undo()
    for name in ("producer", "consumer"):
        assert_idle(engines[name], [], name)


def test_restarted_producer_is_a_new_epoch(demo_model: str, cluster_keys: Any, engines: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = cluster_keys.options("producer2", engine_id="restarting", side_channel_bind=f"tcp://127.0.0.1:{port}")
    consumer = engines["consumer"]
    first = _engine(demo_model, "producer", opts)
    prompt = _prompt(20, 4)
    expected = _reference(engines, "ref-restart", prompt)
    got, _ = _handoff(first, consumer, "warm", prompt)  # the consumer caches first's handshake
    assert got == expected
    stale = run_requests(first, [("restart", prompt, GREEDY.replace(max_tokens=1), PREFILL_LEG,
                                  None)], [])["restart"]
    first.step()  # registers the lease
    first.shutdown()
    second = _engine(demo_model, "producer", opts)  # same id and endpoint, new incarnation
    try:
        kv = decode_leg(stale)
        out = run_requests(consumer, [("restart", prompt, GREEDY, kv, stale.outputs[0].token_ids)], [second])["restart"]
        assert out.outputs[0].finish_reason == "error" and "KV transfer failed" in (out.error or "")
        got, _ = _handoff(second, consumer, "again", prompt)  # fresh params: re-handshake, works
        assert got == expected
        for e, name in ((second, "restarted producer"), (consumer, "consumer")):
            assert_idle(e, [], name)
    finally:
        second.shutdown()


def test_roles_and_params_are_checked(engines: Any) -> None:
    producer, consumer = engines["producer"], engines["consumer"]
    prompt = _prompt(20, 5)
    pre = run_requests(producer, [("roles", prompt, GREEDY.replace(max_tokens=1), PREFILL_LEG,
                                   None)], [])["roles"]
    kv = decode_leg(pre)
    # A producer-only engine does not load remote KV.
    out = run_requests(producer, [("roles-p", prompt, GREEDY, kv, pre.outputs[0].token_ids)], [])["roles-p"]
    assert out.error and "kv_role is 'producer'" in out.error
    # Unsigned params from a producer not in the registry are refused before anything is opened.
    forged = kv.replace(extra={"p2p_sig": "00" * 32})
    out = run_requests(consumer, [("roles", prompt, GREEDY, forged, pre.outputs[0].token_ids)], [producer])["roles"]
    assert out.outputs[0].finish_reason == "error"
    assert consumer.get_stats()["kv_connector"]["p2p_bytes_tcp"] > 0  # (earlier tests moved bytes)
    for name in ("producer", "consumer"):
        assert_idle(engines[name], [], name, timeout_s=30)


def test_aborting_a_held_prefill_frees_its_blocks_before_the_lease_ends(demo_model: str, cluster_keys: Any,
                                                                       engines: Any) -> None:
    """A client that cancels between the legs: the router aborts the finished prefill on its
    worker, which gives the blocks back now, not after the lease TTL; a decode leg that comes
    anyway is refused the dropped lease and never decodes from freed blocks."""
    producer = _engine(demo_model, "producer", cluster_keys.options("producer3", engine_id="ip-abort",
                                                                    lease_ttl_s=120.0))
    try:
        prompt = _prompt(40, 7)
        pre = run_requests(producer, [("held", prompt, GREEDY.replace(max_tokens=1), PREFILL_LEG,
                                       None)], [])["held"]
        assert producer.get_stats()["num_held_for_transfer"] == 1
        producer.abort(["held"])
        deadline = time.monotonic() + 10  # far below the 120 s lease
        while producer.get_stats()["num_held_for_transfer"] and time.monotonic() < deadline:
            producer.step()
            time.sleep(0.01)
        assert_idle(producer, [], "producer")
        kv = decode_leg(pre)
        out = run_requests(engines["consumer"], [("held", prompt, GREEDY, kv, pre.outputs[0].token_ids)],
                           [producer])["held"]
        got = pre.outputs[0].token_ids + out.outputs[0].token_ids
        # Refused the dropped lease: an error under "fail", the right tokens by recompute otherwise.
        assert out.error or got == _reference(engines, "ref-held", prompt), out
        assert_idle(engines["consumer"], [], "consumer")
    finally:
        producer.shutdown()
