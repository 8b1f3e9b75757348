"""Concurrent disaggregation (router disagg_mode="concurrent", router/concurrent_disagg.py) in
front of real prefill and decode `serve-worker` processes (P2P connector, demo model, CPU): the
decode leg is sent with the prefill leg and gets the prefill's params by Worker.ProvideKVParams.

Output equals aggregated token for token; a decode leg waiting for its params is dropped with no
block held when the prefill worker hangs and the client goes away, or the prefill worker dies; the
wait is bounded (DEADLINE_EXCEEDED naming the cause); ProvideKVParams accepts params only for the
request and transfer they were made for, checks its inputs by field and is router-only.

A waiting leg is observed with a harmless probe: ProvideKVParams under a wrong transfer_id answers
PERMISSION_DENIED while the leg waits on that worker and NOT_FOUND once it is gone.
"""

from __future__ import annotations

import asyncio
import pathlib
import random
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from chaos.mark_hold_pool import MarkHoldPool
from pd_pair import p2p_pair_pool, pair_clusters, request, tokens
from real_router_cluster import Cluster, LoopThread, is_idle, wait_until, worker_stats

from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc

LENGTH = common_pb2.FINISH_REASON_LENGTH
WRONG_TRANSFER = "0" * 32


@pytest.fixture(scope="module")
def pool(demo_model: str, key_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarkHoldPool]:
    # Leases outlive every wait here: held KV that returns is let go, never expired.
    p = p2p_pair_pool(demo_model, key_dir, tmp_path_factory.mktemp("concurrent-logs"), (4,), lease_ttl_s=600.0)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def cluster(loop_thread: LoopThread, pool: MarkHoldPool, demo_model: str,
            key_dir: pathlib.Path) -> Iterator[Callable[..., Cluster]]:
    with pair_clusters(loop_thread, pool, demo_model, key_dir, disagg_mode="concurrent") as make:
        yield make


def by_name(c: Cluster, name: str):
    return next(w for w in c.workers if w.name == name)


def provide(address: str, req: worker_pb2.ProvideKVParamsRequest) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as ch:
        try:
            worker_pb2_grpc.WorkerStub(ch).ProvideKVParams(req, timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def waiting_here(address: str, request_id: str) -> bool:
    probe = worker_pb2.ProvideKVParamsRequest(request_id=request_id, transfer_id=WRONG_TRANSFER,
                                              prefill_output_token_ids=[1])
    return provide(address, probe) == grpc.StatusCode.PERMISSION_DENIED


def test_concurrent_equals_aggregated(cluster, reference, tmp_path, monkeypatch):
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("PDCLUSTER_HANDOFF_TRACE", str(trace))  # the router runs in this process
    c = cluster()
    decode = by_name(c, "d0")
    free_before = worker_stats(decode.address).num_kv_blocks_free
    rng = random.Random(20261204)
    for n in (5, 40, 100):
        prompt = [rng.randrange(10, 600) for _ in range(n)]
        out = list(c.stub.Generate(request(prompt, 12), timeout=120))
        want = reference.generate(prompt, max_tokens=12)
        assert out[-1].route.disaggregated and out[-1].finish_reason == LENGTH
        assert tokens(out) == list(want.token_ids)
        assert "".join(r.text for r in out) == want.text
        assert out[-1].usage.completion_tokens == 12
    events = [line.split(" ")[1] for line in trace.read_text().splitlines()]
    assert events.count("r.mode_concurrent") == 3 and events.count("r.provide_sent") == 3, events
    assert "r.concurrent_fallback" not in events
    assert all(wait_until(lambda w=w: is_idle(w.address), 30) for w in c.workers)
    assert worker_stats(decode.address).num_kv_blocks_free == free_before


def test_sequential_stays_the_default(cluster, reference, tmp_path, monkeypatch):
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("PDCLUSTER_HANDOFF_TRACE", str(trace))
    c = cluster(disagg_mode="sequential")
    prompt = [71, 72, 73, 74, 75, 76]
    assert tokens(list(c.stub.Generate(request(prompt, 6), timeout=120))) == reference.tokens(prompt, 6)
    assert "r.mode_concurrent" not in trace.read_text()


def test_client_gone_while_the_decode_leg_waits_frees_it(cluster, loop_thread):
    c = cluster(eject_after_failures=1000)
    prefill, decode = by_name(c, "p0"), by_name(c, "d0")
    free_before = worker_stats(decode.address).num_kv_blocks_free
    request_id = f"conc-{uuid.uuid4().hex[:12]}"
    prefill.pause()  # the prefill leg hangs: the decode leg is admitted and waits
    try:
        stream = c.stub.Generate(request([51, 52, 53, 54, 55, 56, 57], 20, request_id), timeout=120)
        # The call starts when it is first read; read it on a thread so the test can cancel it.
        reader = threading.Thread(target=lambda: [r for r in _swallow(stream)], daemon=True)
        reader.start()
        assert wait_until(lambda: waiting_here(decode.address, request_id), 30)
        assert worker_stats(decode.address).num_kv_blocks_free == free_before  # nothing held meanwhile
        stream.cancel()
        reader.join(30)
        assert wait_until(lambda: not waiting_here(decode.address, request_id), 30)
    finally:
        prefill.resume()
    assert all(wait_until(lambda w=w: is_idle(w.address), 30) for w in c.workers)
    assert worker_stats(decode.address).num_kv_blocks_free == free_before


def test_a_decode_leg_that_timed_out_waiting_falls_back_to_sequential(cluster, reference, tmp_path, monkeypatch):
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("PDCLUSTER_HANDOFF_TRACE", str(trace))
    c = cluster(eject_after_failures=1000, disagg_params_timeout_s=0.2)
    prefill, decode = by_name(c, "p0"), by_name(c, "d0")
    prompt, request_id = [97, 98, 99, 100, 101, 102], f"conc-{uuid.uuid4().hex[:12]}"
    prefill.pause()
    try:
        stream = c.stub.Generate(request(prompt, 8, request_id), timeout=120)
        got: list = []
        reader = threading.Thread(target=lambda: got.extend(stream), daemon=True)
        reader.start()
        assert wait_until(lambda: waiting_here(decode.address, request_id), 30)
        assert wait_until(lambda: not waiting_here(decode.address, request_id), 30)  # timed out there
    finally:
        prefill.resume()
    reader.join(60)
    assert tokens(got) == reference.tokens(prompt, 8) and got[-1].finish_reason == LENGTH
    assert "r.concurrent_fallback" in trace.read_text()
    assert all(wait_until(lambda w=w: is_idle(w.address), 30) for w in c.workers)


def test_router_abort_while_the_decode_leg_waits_frees_it(cluster):
    c = cluster(eject_after_failures=1000)
    prefill, decode = by_name(c, "p0"), by_name(c, "d0")
    free_before = worker_stats(decode.address).num_kv_blocks_free
    request_id = f"conc-{uuid.uuid4().hex[:12]}"
    prefill.pause()
    try:
        stream = c.stub.Generate(request([91, 92, 93, 94, 95], 20, request_id), timeout=120)
        got: list = []
        reader = threading.Thread(target=lambda: got.extend(_swallow(stream)), daemon=True)
        reader.start()
        assert wait_until(lambda: waiting_here(decode.address, request_id), 30)
        resp = c.stub.Abort(common_pb2.AbortRequest(request_ids=[request_id]), timeout=30)
        assert list(resp.aborted_request_ids) == [request_id]
        assert wait_until(lambda: not waiting_here(decode.address, request_id), 30)
        reader.join(60)
        assert not tokens(got)
    finally:
        prefill.resume()
    assert all(wait_until(lambda w=w: is_idle(w.address), 30) for w in c.workers)
    assert worker_stats(decode.address).num_kv_blocks_free == free_before


def test_prefill_worker_dead_while_the_decode_leg_waits(cluster):
    c = cluster(eject_after_failures=1000, max_retries=0)
    prefill, decode = by_name(c, "p0"), by_name(c, "d0")
    free_before = worker_stats(decode.address).num_kv_blocks_free
    request_id = f"conc-{uuid.uuid4().hex[:12]}"
    prefill.pause()
    stream = c.stub.Generate(request([61, 62, 63, 64, 65], 20, request_id), timeout=120)
    result: dict[str, Any] = {}
    reader = threading.Thread(target=lambda: result.update(err=_error_of(stream)), daemon=True)
    reader.start()
    assert wait_until(lambda: waiting_here(decode.address, request_id), 30)
    prefill.kill()  # the prefill leg fails UNAVAILABLE; no other prefill worker to retry on
    reader.join(60)
    assert result.get("err") is not None, "the request should fail before any output"
    assert wait_until(lambda: not waiting_here(decode.address, request_id), 30)
    assert wait_until(lambda: is_idle(decode.address), 30)
    assert worker_stats(decode.address).num_kv_blocks_free == free_before


def test_an_abort_that_comes_after_the_prefill_leg_ended_frees_its_held_kv(pool):
    """The router cancels a prefill leg whose last reply is already on its way (a stalled prefill
    worker resumed and finished it before reading the abort): the KV it handed out is let go at
    the abort, not at lease expiry (600 s in this module)."""
    (prefill,) = pool.take_named(("p0",))
    leg = worker_pb2.WorkerGenerateRequest(
        request_id=f"late-{uuid.uuid4().hex[:12]}", prompt_token_ids=list(range(40, 80)), stream=False,
        sampling_params=common_pb2.SamplingParams(max_tokens=1, temperature=0.0))
    leg.kv_transfer_params.do_remote_decode = True
    leg.kv_transfer_params.transfer_id = uuid.uuid4().hex

    async def run() -> None:
        async with grpc.aio.insecure_channel(prefill.address) as ch:
            call = worker_pb2_grpc.WorkerStub(ch).GenerateStream()
            await call.write(worker_pb2.WorkerStreamRequest(generate=[worker_pb2.StreamGenerate(request=leg, tag=7)]))
            msg = await call.read()
            (reply,) = msg.deltas
            assert reply.finished and reply.HasField("kv_transfer_params") and reply.stream_tag == 7
            assert worker_stats(prefill.address).num_kv_blocks_used > 0  # held for a decode leg
            await call.write(worker_pb2.WorkerStreamRequest(abort_tags=[7]))
            assert await asyncio.to_thread(wait_until, lambda: is_idle(prefill.address), 30)
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF

    asyncio.run(run())


def _swallow(stream) -> Iterator[Any]:
    try:
        yield from stream
    except grpc.RpcError:
        return


def _error_of(stream) -> grpc.StatusCode | None:
    try:
        list(stream)
    except grpc.RpcError as e:
        return e.code()
    return None


# -- the worker's side, asked directly ---------------------------------------------------------------
def _waiting_leg(address: str, request_id: str, transfer_id: str, prompt: list[int], max_tokens: int = 6,
                 timeout_s: float | None = 30.0) -> tuple[threading.Thread, dict[str, Any]]:
    """A decode leg admitted with await_kv_transfer_id, read on a thread: (thread, result)."""
    req = worker_pb2.WorkerGenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, stream=True, await_kv_transfer_id=transfer_id,
        sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    if timeout_s is not None:
        req.kv_params_timeout_s = timeout_s
    result: dict[str, Any] = {"tokens": []}

    def read() -> None:
        with grpc.insecure_channel(address) as ch:
            try:
                for r in worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=120):
                    result["tokens"] += list(r.token_ids)
            except grpc.RpcError as e:
                result["code"], result["details"] = e.code(), e.details()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t, result


def test_waiting_decode_leg_times_out_with_a_clear_error(pool):
    decode = pool.take_named(("d0",))[0]
    t, result = _waiting_leg(decode.address, f"conc-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex, [5, 6, 7],
                             timeout_s=0.3)
    t.join(60)
    assert result.get("code") == grpc.StatusCode.DEADLINE_EXCEEDED, result
    assert "kv_transfer_params" in result["details"] and "kv_params_timeout_s" in result["details"]
    assert wait_until(lambda: is_idle(decode.address), 30)


def test_provide_binds_params_to_their_request_and_checks_fields(pool, reference):
    decode = pool.take_named(("d0",))[0]
    free_before = worker_stats(decode.address).num_kv_blocks_free
    request_id, transfer_id = f"conc-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex
    prompt = [81, 82, 83, 84, 85, 86, 87, 88]
    want = reference.tokens(prompt, 6)
    t, result = _waiting_leg(decode.address, request_id, transfer_id, prompt)
    assert wait_until(lambda: waiting_here(decode.address, request_id), 30)

    def ask(**fields: Any) -> grpc.StatusCode:
        base: dict[str, Any] = {"request_id": request_id, "transfer_id": transfer_id,
                                "prefill_output_token_ids": want[:1]}
        return provide(decode.address, worker_pb2.ProvideKVParamsRequest(**{**base, **fields}))

    assert ask(request_id="conc-nobody") == grpc.StatusCode.NOT_FOUND
    assert ask(transfer_id=uuid.uuid4().hex) == grpc.StatusCode.PERMISSION_DENIED
    made_for_other = common_pb2.KvTransferParams(do_remote_prefill=True, request_id="conc-other",
                                                 producer_id="p0", num_tokens=len(prompt))
    assert ask(kv_transfer_params=made_for_other) == grpc.StatusCode.PERMISSION_DENIED
    other_transfer = common_pb2.KvTransferParams(do_remote_prefill=True, request_id=request_id,
                                                 transfer_id=uuid.uuid4().hex, producer_id="p0")
    assert ask(kv_transfer_params=other_transfer) == grpc.StatusCode.PERMISSION_DENIED
    assert ask(kv_transfer_params=common_pb2.KvTransferParams(do_remote_decode=True)) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert ask(prefill_output_token_ids=[]) == grpc.StatusCode.INVALID_ARGUMENT
    assert ask(prefill_output_token_ids=[1] * 17) == grpc.StatusCode.INVALID_ARGUMENT
    assert waiting_here(decode.address, request_id)  # none of that changed anything
    # No params (the prefill kept no KV): the decode leg computes the prompt itself, after t0.
    assert ask() == grpc.StatusCode.OK
    # Once only: a second provide is refused, FAILED_PRECONDITION while the leg still runs, NOT_FOUND
    # once it has finished (one call: asking twice would race the leg's end).
    assert ask() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
    t.join(60)
    assert "code" not in result, result
    assert result["tokens"] == want[1:]
    assert wait_until(lambda: is_idle(decode.address), 30)
    assert worker_stats(decode.address).num_kv_blocks_free == free_before


@pytest.mark.parametrize("fields, code, named", [
    ({"await_kv_transfer_id": "xyz"}, grpc.StatusCode.INVALID_ARGUMENT, "await_kv_transfer_id"),
    ({"kv_params_timeout_s": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "kv_params_timeout_s"),
    ({"prefill_output_token_ids": [3]}, grpc.StatusCode.INVALID_ARGUMENT, "prefill_output_token_ids"),
])
def test_waiting_leg_inputs_are_checked_by_field(pool, fields, code, named):
    decode = pool.take_named(("d0",))[0]
    req = worker_pb2.WorkerGenerateRequest(request_id=f"conc-{uuid.uuid4().hex[:12]}", prompt_token_ids=[1, 2, 3],
                                           await_kv_transfer_id=uuid.uuid4().hex,
                                           sampling_params=common_pb2.SamplingParams(max_tokens=4))
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(req, name).extend(value)
        else:
            setattr(req, name, value)
    with grpc.insecure_channel(decode.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=30))
    assert err.value.code() == code and named in err.value.details()


def test_a_prefill_worker_refuses_a_waiting_decode_leg(pool):
    prefill = pool.take_named(("p0",))[0]
    req = worker_pb2.WorkerGenerateRequest(request_id=f"conc-{uuid.uuid4().hex[:12]}", prompt_token_ids=[1, 2, 3],
                                           await_kv_transfer_id=uuid.uuid4().hex,
                                           sampling_params=common_pb2.SamplingParams(max_tokens=4))
    with grpc.insecure_channel(prefill.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


# -- units ---------------------------------------------------------------------------------------------
def test_provide_is_router_only():
    from pdcluster.worker.server import worker_policy

    policy = worker_policy()
    method = "/pdcluster.v1.Worker/ProvideKVParams"
    assert policy.allowed[method] == {"router"}

    class Ctx:
        def __init__(self, role: str) -> None:
            self.role = role

        def auth_context(self) -> dict:
            return {"peer_spiffe_id": [f"spiffe://pdcluster/{self.role}/x".encode()]}

        def peer(self) -> str:
            return "ipv4:127.0.0.1:1"

    assert policy.check(method, Ctx("router")) is None
    for role in ("prefill", "decode", "client"):
        assert policy.check(method, Ctx(role)) is not None


def test_router_mode_option():
    from pdcluster.router.config import RouterConfig

    assert RouterConfig().disagg_mode == "sequential"
    with pytest.raises(ValueError, match="disagg_mode"):
        RouterConfig(disagg_mode="parallel")
    with pytest.raises(ValueError, match="disagg_params_timeout_s"):
        RouterConfig(disagg_params_timeout_s=0)
