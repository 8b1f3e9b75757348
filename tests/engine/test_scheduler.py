"""Scheduler driven by hand-made ModelRunnerOutputs: budgets, FCFS, preemption, stops, connectors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdcluster.config import CacheConfig, SchedulerConfig
from pdcluster.engine.kv_connector import (
    KVCacheLayout,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferFailure,
)
from pdcluster.engine.kv_transfer_params import KVTransferParams
from pdcluster.engine.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.scheduler import Scheduler
from pdcluster.sampling_params import SamplingParams

EOS = 2


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 32,
         max_model_len: int = 128, chunked: bool = True, caching: bool = True,
         connector: KVConnectorBase | None = None, policy: str = "fcfs", load_wait_s: float = 0.0,
         long_prefill: int = 0) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, chunked, policy, load_wait_s, long_prefill),
                     CacheConfig(block_size, num_blocks, 0, "float32", caching), connector=connector)


def req(rid: str, num_prompt: int, start: int = 10, **sp) -> Request:
    sp.setdefault("max_tokens", 4)
    return Request(rid, list(range(start, start + num_prompt)), SamplingParams(**sp), eos_token_ids=(EOS,))


def step(s: Scheduler, sample: Callable[[Request], int] = lambda r: 7,
         **runner_reports) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step with a fake runner: a request whose known tokens are all computed samples."""
    so = s.schedule()
    req_ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        r = s.requests[rid]
        req_ids.append(rid)
        sampled.append([sample(r)] if r.num_computed_tokens >= r.num_tokens else [])
    return so, s.update(so, ModelRunnerOutput(req_ids, sampled, **runner_reports))


def run_all(s: Scheduler, max_steps: int = 500, **kw) -> dict[str, list[EngineCoreOutput]]:
    outs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outs
        for o in step(s, **kw)[1]:
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("scheduler did not drain")


def assert_no_leaks(s: Scheduler) -> None:
    assert s.kv.req_to_blocks == {} and s.get_stats()["kv_blocks_used"] == 0
    assert not s.requests and not s.remote.held and not s.running and not s.waiting


# == budget, FCFS, limits ==========================================================================
def test_chunked_prefill_shares_the_budget_decodes_first() -> None:
    s = make(budget=8)
    s.add_request(req("a", 6))
    s.add_request(req("b", 20))
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 6, "b": 2} and so.total_num_scheduled_tokens == 8
    assert [o.request_id for o in outs] == ["a"]  # b's chunk stopped short of its last token
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    assert [c.request_id for c in so.scheduled_cached_reqs] == ["a", "b"] and not so.scheduled_new_reqs
    assert s.requests["b"].num_computed_tokens == 9
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 4} and {o.request_id for o in outs} == {"a", "b"}


def test_long_prefill_token_threshold_caps_every_prompt_chunk_not_decodes() -> None:
    """vLLM's long_prefill_token_threshold: each prompt chunk (new or running, one per request)
    computes at most that many tokens a step, the budget left to others; decodes are untouched."""
    s = make(budget=32, long_prefill=5)
    s.add_request(req("a", 3))
    s.add_request(req("b", 12))
    s.add_request(req("c", 7))
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 3, "b": 5, "c": 5}  # a's whole prompt is under the cap
    assert [o.request_id for o in outs] == ["a"]
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 5, "c": 2}
    assert {o.request_id for o in outs} == {"a", "c"}
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 2, "c": 1}
    run_all(s)
    assert_no_leaks(s)


def test_max_num_seqs_and_fcfs() -> None:
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 3))
    so, _ = step(s)
    assert [n.request_id for n in so.scheduled_new_reqs] == ["a", "b"]
    assert s.get_stats()["num_waiting"] == 1


def test_without_chunking_a_prompt_waits_whole_and_blocks_the_queue() -> None:
    s = make(budget=10, chunked=False)
    s.add_request(req("a", 3, max_tokens=3))
    step(s)
    s.add_request(req("b", 10))
    s.add_request(req("c", 2))
    so, _ = step(s)  # a decodes (1 token): 9 left, b needs 10 and c must not jump the queue
    assert so.num_scheduled_tokens == {"a": 1}
    step(s)  # a finishes
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"b": 10}


def test_without_chunking_a_prompt_larger_than_the_budget_is_chunked_anyway() -> None:
    s = make(budget=8, chunked=False)
    s.add_request(req("a", 20))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 8}
    assert run_all(s)["a"][-1].finish_reason == "length"


def test_prefix_cache_hit_is_reported_and_counted() -> None:
    s = make()
    s.add_request(req("a", 10))
    run_all(s)
    s.add_request(req("b", 10))
    so, _ = step(s)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and so.num_scheduled_tokens == {"b": 2}
    outs = run_all(s)["b"]
    assert all(o.num_cached_tokens == 8 for o in outs)
    stats = s.get_stats()
    assert stats["prefix_cache_hits"] == 8 and stats["prefix_cache_hit_rate"] == pytest.approx(8 / 20)
    assert_no_leaks(s)


# == preemption ====================================================================================
def test_preemption_by_recompute_and_resume() -> None:
    # 6 blocks of 4; two requests of 8 + 12 tokens (5 blocks each) cannot both grow.
    s = make(num_blocks=6, budget=64)
    s.add_request(req("a", 8, max_tokens=12))
    s.add_request(req("b", 8, start=50, max_tokens=12))
    preempted_in: SchedulerOutput | None = None
    resumed = None
    outs: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        so, step_outs = step(s, sample=lambda r: 100 + r.num_output_tokens)
        if "b" in so.finished_request_ids and preempted_in is None:
            preempted_in = so
        resumed = resumed or next((n for n in so.scheduled_new_reqs if n.output_token_ids), None)
        for o in step_outs:
            outs[o.request_id] += o.new_token_ids
    assert preempted_in is not None, "b (the most recently added) must be preempted"
    assert "b" not in preempted_in.num_scheduled_tokens
    assert resumed is not None and resumed.request_id == "b"
    assert resumed.output_token_ids == [100 + i for i in range(len(resumed.output_token_ids))]
    assert outs == {"a": list(range(100, 112)), "b": list(range(100, 112))}
    assert s.get_stats()["num_preemptions"] >= 1
    assert_no_leaks(s)


def test_preempted_request_goes_to_the_front_of_the_queue() -> None:
    s = make(num_blocks=4, budget=64, max_num_seqs=2)
    s.add_request(req("a", 4, max_tokens=8))
    s.add_request(req("b", 4, start=50, max_tokens=8))
    s.add_request(req("c", 4, start=80, max_tokens=1))
    for _ in range(5):  # a, b admitted; they grow to 9 tokens (2 blocks each: the cache is full)
        step(s)
    assert [r.request_id for r in s.waiting] == ["c"]
    so, _ = step(s)  # a needs a third block: b, the most recently added, is preempted
    assert so.num_scheduled_tokens == {"a": 1} and so.finished_request_ids == {"b"}
    assert [r.request_id for r in s.waiting] == ["b", "c"] and s.waiting[0].status == RequestStatus.PREEMPTED
    run_all(s)
    assert_no_leaks(s)


# == --scheduling-policy priority ====================================================================
def test_priority_orders_admission_lower_first_then_arrival() -> None:
    s = make(max_num_seqs=2, policy="priority")
    for rid, prio in (("a", 5), ("b", 0), ("c", -1), ("d", 0)):
        s.add_request(req(rid, 3, priority=prio))
    so, _ = step(s)
    assert [n.request_id for n in so.scheduled_new_reqs] == ["c", "b"]
    assert [r.request_id for r in s.waiting] == ["d", "a"]
    assert list(run_all(s)) and [r.request_id for r in s.waiting] == []
    assert_no_leaks(s)


def test_priority_preempts_the_lowest_not_the_latest() -> None:
    """b (priority 1) is admitted first, a (priority 0) after it: when a needs a block, b goes
    (fcfs would take a, the most recent); b waits behind c (priority 0) that outranks it."""
    s = make(num_blocks=4, budget=64, max_num_seqs=2, policy="priority")
    s.add_request(req("b", 4, start=50, max_tokens=8, priority=1))
    step(s)
    s.add_request(req("a", 4, max_tokens=8))
    s.add_request(req("c", 4, start=80, max_tokens=1))
    for _ in range(4):
        step(s)
    assert [r.request_id for r in s.running] == ["a", "b"]  # by priority, not admission order
    for _ in range(8):
        so, _ = step(s)
        if so.finished_request_ids:
            break
    assert so.finished_request_ids == {"b"} and "a" in so.num_scheduled_tokens
    assert [r.request_id for r in s.waiting] == ["c", "b"]
    run_all(s)
    assert_no_leaks(s)


def test_fcfs_keeps_the_running_order_whatever_the_priority() -> None:
    s = make(max_num_seqs=2)
    s.add_request(req("a", 3, priority=0))
    s.add_request(req("b", 3, priority=0))
    step(s)
    assert [r.request_id for r in s.running] == ["a", "b"]


# == stop checks ===================================================================================
@pytest.mark.parametrize("params, tokens, n, reason, stop_reason", [
    (dict(max_tokens=5), [7, EOS, 7], 2, "stop", None),
    (dict(max_tokens=5, ignore_eos=True), [7, EOS, 7, 7, 7, 7], 5, "length", None),
    (dict(max_tokens=5, stop_token_ids=[9]), [7, 9], 2, "stop", 9),
    (dict(max_tokens=5, min_tokens=3), [EOS, 9, EOS, 7], 3, "stop", None),
    (dict(max_tokens=5, min_tokens=2, stop_token_ids=[9]), [9, 9], 2, "stop", 9),
    (dict(max_tokens=3), [7, 7, 7, 7], 3, "length", None),
    (dict(max_tokens=2), [7, EOS], 2, "stop", None),  # a stop token on the last allowed token
])
def test_stop_checks(params: dict, tokens: list[int], n: int, reason: str, stop_reason) -> None:
    s = make()
    s.add_request(req("a", 5, **params))
    seq = iter(tokens)
    outs = run_all(s, sample=lambda r: next(seq))["a"]
    assert [t for o in outs for t in o.new_token_ids] == tokens[:n]
    assert outs[-1].finish_reason == reason and outs[-1].stop_reason == stop_reason
    assert all(o.finish_reason is None for o in outs[:-1])
    assert_no_leaks(s)


def test_max_model_len_finishes_with_length() -> None:
    s = make(max_model_len=8)
    s.add_request(req("a", 6, max_tokens=100))
    outs = run_all(s)["a"]
    assert sum(len(o.new_token_ids) for o in outs) == 2 and outs[-1].finish_reason == "length"


# == bad things ====================================================================================
def test_abort_frees_blocks_and_unknown_ids_are_ignored() -> None:
    s = make()
    s.add_request(req("a", 9, max_tokens=50))
    s.add_request(req("w", 9, max_tokens=50))
    step(s)
    assert s.get_stats()["kv_blocks_used"] > 0
    s.finish_requests(["a", "w", "nope"], RequestStatus.FINISHED_ABORTED)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    so, outs = step(s)
    assert so.finished_request_ids == {"a", "w"} and outs == []
    assert_no_leaks(s)
    with pytest.raises(ValueError):
        s.finish_requests(["a"], RequestStatus.RUNNING)


def test_duplicate_id_rejected_without_touching_the_original() -> None:
    s = make()
    s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="already in flight"):
        s.add_request(req("a", 3))
    assert run_all(s)["a"][-1].finish_reason == "length"


def test_requests_that_can_never_fit_finish_with_an_error() -> None:
    s = make(num_blocks=4, max_model_len=64)
    s.add_request(req("huge", 17))  # 5 blocks > 4
    s.add_request(req("long", 65))  # > max_model_len
    s.add_request(req("grows", 12, max_tokens=20))  # fits, then outgrows the cache
    outs = run_all(s)
    assert outs["huge"][-1].finish_reason == "error" and "4 blocks" in outs["huge"][-1].error
    assert "max_model_len" in outs["long"][-1].error
    assert outs["grows"][-1].finish_reason == "error"
    # KV for positions 0..15 fits in 4 blocks: 5 tokens are sampled, then position 16 does not fit.
    assert sum(len(o.new_token_ids) for o in outs["grows"]) == 5
    assert_no_leaks(s)


# == KV connector ==================================================================================
class ScriptedConnector(KVConnectorBase):
    """Scheduler side scripted per request id: matches[rid] = list of (num_tokens | None, is_async),
    one per call (the last one repeats)."""

    def __init__(self, matches: dict[str, list[tuple[int | None, bool]]] | None = None,
                 delay_free: bool = False, failure_policy: str = "fail") -> None:
        super().__init__(KVConnectorRole.SCHEDULER, failure_policy)
        self.matches = matches or {}
        self.delay_free = delay_free
        self.calls: list[tuple] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        script = self.matches.get(request.request_id, [(0, False)])
        self.calls.append(("match", request.request_id, num_computed_tokens))
        return script.pop(0) if len(script) > 1 else script[0]

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("alloc", request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id))
        return self.delay_free, {"producer": "p0", "block_ids": list(block_ids)}

    # Worker side is not exercised by the scheduler.
    def register_kv_caches(self, kv_caches, layout):
        pass

    def start_load_kv(self, meta):
        pass

    def wait_for_layer_load(self, layer):
        pass

    def save_kv_layer(self, layer, kv_layer, meta):
        pass

    def wait_for_save(self):
        pass

    def get_finished(self):
        return set(), set()


def test_async_load_waits_for_remote_kv_then_runs() -> None:
    conn = ScriptedConnector({"a": [(None, False), (12, True)]})
    s = make(connector=conn)
    s.add_request(req("a", 12))
    so, _ = step(s)  # None: ask again, nothing changes
    assert so.is_empty and s.requests["a"].status == RequestStatus.WAITING and not s.kv.req_to_blocks
    so, _ = step(s)
    a = s.requests["a"]
    assert so.is_empty and a.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert conn.calls[-1] == ("alloc", "a", s.kv.get_block_ids("a"), 11)  # the last token is computed
    assert isinstance(so.kv_connector_metadata, KVConnectorMetadata)
    so, _ = step(s)
    assert so.is_empty and s.get_stats()["num_waiting_for_remote_kv"] == 1
    assert s.get_stats()["kv_blocks_cached"] == 0  # loading blocks are not shareable
    step(s, finished_recving={"a"})
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 11
    assert s.get_stats()["kv_blocks_cached"] == 2
    so, outs = step(s)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 11 and so.num_scheduled_tokens == {"a": 1}
    assert outs[0].new_token_ids == [7] and outs[0].num_cached_tokens == 11
    run_all(s)
    assert_no_leaks(s)


def test_only_waiting_while_a_transfer_is_all_that_is_left() -> None:
    """What lets the engine wait for a transfer's wake-up instead of stepping again at once."""
    conn = ScriptedConnector({"a": [(12, True)]})
    s = make(connector=conn)
    assert not s.only_waiting()  # nothing at all
    s.add_request(req("a", 12))
    step(s)
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KV and s.only_waiting()
    step(s, finished_recving={"a"})
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1}  # loaded: it runs (a step with tokens never waits)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.has_unfinished_requests() and not s.only_waiting()  # the runner's drop is still to deliver
    step(s)
    assert not s.has_unfinished_requests() and not s.only_waiting()
    assert_no_leaks(s)


def decode_leg_req(rid: str, num_prompt: int, start: int = 10, **sp) -> Request:
    r = req(rid, num_prompt, start, **sp)
    r.kv_transfer_params = KVTransferParams(do_remote_prefill=True, connector="scripted", request_id=rid)
    return r


def with_running_bg(conn: ScriptedConnector, load_wait_s: float, max_tokens: int = 10) -> Scheduler:
    """A scheduler with kv_load_wait_s whose request "bg" is running (prefilled in one step)."""
    s = make(connector=conn, load_wait_s=load_wait_s)
    s.add_request(req("bg", 6, start=40, max_tokens=max_tokens))
    step(s)
    return s


def test_a_load_first_step_starts_the_loads_alone_then_runs_them_with_the_others() -> None:
    """kv_load_wait_s: with a request running, a decode leg at the head of the queue gets a step
    that only starts its load (the running one skips it); once the load is collected by a step
    that computes nothing, the next step runs both."""
    s = with_running_bg(ScriptedConnector({"a": [(12, True)]}), 0.5)
    bg = s.requests["bg"]
    assert bg.status == RequestStatus.RUNNING and bg.num_computed_tokens == 6
    s.add_request(decode_leg_req("a", 12))
    so, outs = step(s)
    assert so.load_first == ["a"] and so.is_empty and not outs  # bg waits with the load
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KV and s.loading_any(["a"])
    assert bg.num_computed_tokens == 6
    idle = s.schedule_idle()
    assert idle.is_empty and not idle.load_first
    s.update(idle, ModelRunnerOutput([], [], finished_recving={"a"}))
    assert not s.loading_any(["a"]) and s.requests["a"].status == RequestStatus.WAITING
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"bg": 1, "a": 1} and not so.load_first
    assert {o.request_id for o in outs} == {"bg", "a"}
    run_all(s)
    assert_no_leaks(s)


def test_one_load_first_step_per_step_of_the_running_requests() -> None:
    """A decode leg that arrives during a hold does not get a hold of its own before the running
    request steps again: its load starts beside that step (so a stream of hand-offs never
    starves the running batch), and the hold is available again after it."""
    loads = {rid: [(8, True)] for rid in "bcd"}
    s = with_running_bg(ScriptedConnector({"a": [(12, True)], **loads}), 0.5, max_tokens=20)
    s.add_request(decode_leg_req("a", 12))
    so, _ = step(s)
    assert so.load_first == ["a"]
    s.add_request(decode_leg_req("b", 8, start=60))  # arrived while the engine held for a
    # The hold ran out with a still loading: b heads the queue, but bg steps first.
    so, _ = step(s)
    assert not so.load_first and so.num_scheduled_tokens == {"bg": 1}
    assert s.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KV  # its load started beside
    s.add_request(decode_leg_req("c", 8, start=80))
    so, _ = step(s)
    assert so.load_first == ["c"]  # bg stepped since the last hold
    idle = s.schedule_idle()
    s.update(idle, ModelRunnerOutput([], [], finished_recving={"a", "b", "c"}))  # they landed: the hold ends
    s.add_request(decode_leg_req("d", 8, start=90))
    so, _ = step(s)  # the loaded ones head the queue: they run with bg; d's load starts beside
    assert not so.load_first and so.num_scheduled_tokens == {"bg": 1, "a": 1, "b": 1, "c": 1}
    assert s.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    run_all(s, finished_recving={"d"})
    assert_no_leaks(s)


def test_load_first_only_when_a_load_heads_the_queue_and_others_run() -> None:
    # Off (the default): the load starts beside the running request's step.
    s = with_running_bg(ScriptedConnector({"a": [(12, True)]}), 0.0)
    s.add_request(decode_leg_req("a", 12))
    so, _ = step(s)
    assert not so.load_first and so.num_scheduled_tokens == {"bg": 1}
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    # On, but nothing runs: a plain step (nobody to hold).
    s = make(connector=ScriptedConnector({"a": [(12, True)]}), load_wait_s=0.5)
    s.add_request(decode_leg_req("a", 12))
    so, _ = step(s)
    assert not so.load_first and s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    # On, a request runs, but a plain request heads the queue: a plain step admits it.
    s = with_running_bg(ScriptedConnector(), 0.5)
    s.add_request(req("b", 5))
    so, _ = step(s)
    assert not so.load_first and so.num_scheduled_tokens == {"bg": 1, "b": 5}


def test_a_load_first_step_stops_at_the_first_request_that_computes() -> None:
    """Decode legs a and c around a plain request b: the load-first step starts a's load only (b
    would compute; c stays behind it, first come first served); the next step runs bg and admits
    b, then c's load starts."""
    s = with_running_bg(ScriptedConnector({"a": [(12, True)], "c": [(8, True)]}), 0.5)
    s.add_request(decode_leg_req("a", 12))
    s.add_request(req("b", 5))
    s.add_request(decode_leg_req("c", 8, start=70))
    so, _ = step(s)
    assert so.load_first == ["a"] and so.is_empty
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    so, _ = step(s, finished_recving={"a"})  # nothing to hold for: b heads the queue
    assert not so.load_first and so.num_scheduled_tokens == {"bg": 1, "b": 5}
    assert s.requests["c"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    run_all(s, finished_recving={"c"})
    assert_no_leaks(s)


def test_sync_external_tokens_are_scheduled_at_once() -> None:
    conn = ScriptedConnector({"a": [(8, False)]})
    s = make(connector=conn)
    s.add_request(req("a", 10))
    so, _ = step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8 and so.num_scheduled_tokens == {"a": 2}
    assert ("alloc", "a", s.kv.get_block_ids("a"), 8) in conn.calls


def test_delay_free_holds_blocks_until_finished_sending() -> None:
    conn = ScriptedConnector(delay_free=True)
    s = make(connector=conn)
    s.add_request(req("a", 10, max_tokens=1))
    _, outs = step(s)
    assert outs[0].finish_reason == "length"
    assert outs[0].kv_transfer_params["block_ids"] == [0, 1, 2]
    assert s.get_stats()["kv_blocks_used"] == 3 and s.has_unfinished_requests()
    step(s)
    assert s.get_stats()["kv_blocks_used"] == 3
    step(s, finished_sending={"a", "unknown"})
    assert_no_leaks(s)
    assert not s.has_unfinished_requests()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_invalid_blocks_during_async_load(policy: str) -> None:
    conn = ScriptedConnector({"a": [(12, True)]}, failure_policy=policy)
    s = make(connector=conn)
    s.add_request(req("a", 13))
    step(s)
    bad = s.kv.get_block_ids("a")[1]
    so, outs = step(s, invalid_block_ids={bad}, finished_recving={"a"})
    if policy == "fail":
        assert outs[0].finish_reason == "error" and "KV transfer failed" in outs[0].error
        assert "a" not in s.requests and s.kv.req_to_blocks == {}
    else:
        a = s.requests["a"]
        assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 4  # first bad block
        assert s.get_stats()["kv_blocks_cached"] == 1
        so, _ = step(s)
        assert so.num_scheduled_tokens == {"a": 9}
    run_all(s)
    assert_no_leaks(s)


def test_invalid_blocks_after_sync_load_recompute_preempts() -> None:
    conn = ScriptedConnector({"a": [(8, False), (0, False)]}, failure_policy=KVTransferFailure.RECOMPUTE)
    s = make(connector=conn)
    s.add_request(req("a", 10))
    so = s.schedule()
    bad = s.kv.get_block_ids("a")[1]
    outs = s.update(so, ModelRunnerOutput(["a"], [[7]], invalid_block_ids={bad}))
    a = s.requests["a"]
    assert outs == [] and a.output_token_ids == []  # the token sampled from bad KV is dropped
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    so, _ = step(s)
    assert "a" in so.finished_request_ids and not so.scheduled_new_reqs  # drop state first, then resume
    so, _ = step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4  # the good block, from the prefix cache
    run_all(s)
    assert_no_leaks(s)


def test_abort_during_remote_load_frees_blocks_only_when_load_reports() -> None:
    conn = ScriptedConnector({"a": [(12, True)]})
    s = make(connector=conn)
    s.add_request(req("a", 13))
    step(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert ("finished", "a") in conn.calls and s.get_stats()["kv_blocks_used"] == 3
    step(s)
    assert s.get_stats()["kv_blocks_used"] == 3  # the load may still be writing
    step(s, finished_recving={"a"})
    assert_no_leaks(s)


def test_connector_error_fails_one_request_not_the_engine() -> None:
    class Broken(ScriptedConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            if request.request_id == "bad":
                raise RuntimeError("peer unreachable")
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

    s = make(connector=Broken())
    s.add_request(req("bad", 5))
    s.add_request(req("ok", 5))
    outs = run_all(s)
    assert outs["bad"][-1].finish_reason == "error" and "peer unreachable" in outs["bad"][-1].error
    assert outs["ok"][-1].finish_reason == "length"
    assert_no_leaks(s)


def test_kv_events_flow_out() -> None:
    s = make()
    s.add_request(req("a", 9))
    run_all(s)
    events = s.take_kv_events()
    assert events and s.take_kv_events() == []


def test_layout_validates_and_maps_heads() -> None:
    lay = KVCacheLayout(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=64,
                        dtype="bfloat16", tp_rank=1, tp_size=4, total_num_kv_heads=8)
    assert lay.layer_shape == (2, 8, 16, 2, 64) and lay.global_head_range() == (2, 4)
    assert lay.block_nbytes == 16 * 2 * 64 * 2
    rep = KVCacheLayout(2, 8, 16, 1, 64, "float16", tp_rank=3, tp_size=4, total_num_kv_heads=2)
    assert rep.global_head_range() == (1, 2)  # replicated: ranks 2, 3 share head 1
    with pytest.raises(ValueError, match="share"):
        KVCacheLayout(2, 8, 16, 4, 64, "float16", tp_size=4, total_num_kv_heads=8)


# == randomized: invariants under everything at once ===============================================
class FakeRunner:
    """Keeps the state a model runner keeps and checks every SchedulerOutput against it."""

    def __init__(self, s: Scheduler, sample: Callable[[], int]) -> None:
        self.s, self.sample = s, sample
        self.state: dict[str, dict] = {}  # req_id -> tokens, computed, blocks

    def execute(self, so: SchedulerOutput, **reports) -> ModelRunnerOutput:
        for rid in so.finished_request_ids:
            self.state.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.request_id not in self.state, "resumed before its old state was dropped"
            self.state[new.request_id] = dict(tokens=new.prompt_token_ids + new.output_token_ids,
                                          computed=new.num_computed_tokens, blocks=list(new.block_ids))
        for c in so.scheduled_cached_reqs:
            st = self.state[c.request_id]
            assert st["computed"] == c.num_computed_tokens
            st["blocks"] += c.new_block_ids
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.state[rid]
            assert st["blocks"] == self.s.kv.get_block_ids(rid)
            assert n > 0 and st["computed"] + n <= len(st["tokens"])
            assert len(st["blocks"]) * self.s.block_size >= st["computed"] + n
            st["computed"] += n
            req_ids.append(rid)
            if st["computed"] == len(st["tokens"]):
                st["tokens"].append(self.sample())
                sampled.append(st["tokens"][-1:])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled, **reports)


def _check_invariants(s: Scheduler) -> None:
    held_by: dict[int, int] = {}
    for blocks in s.kv.req_to_blocks.values():
        for b in blocks:
            held_by[b.block_id] = held_by.get(b.block_id, 0) + 1
    pool = s.kv.pool
    for b in pool.blocks:
        assert b.ref_cnt == held_by.get(b.block_id, 0), b
        assert (b.ref_cnt == 0) == (b.block_id in pool._free), b
        assert b.block_hash is None or pool._cached[b.block_hash] is b
    assert set(s.kv.req_to_blocks) <= set(s.requests) | set(s.remote.held)
    assert len(s.running) <= s.config.max_num_seqs
    for r in s.running:
        assert r.status == RequestStatus.RUNNING and r.num_computed_tokens <= r.num_tokens


def _random_reports(s: Scheduler, rng) -> dict:
    if not (s.remote.loading or s.remote.held):
        return {}
    pending = list(s.remote.loading) + list(s.remote.held)
    reports = dict(finished_recving={r for r in pending if rng.random() < 0.3},
                   finished_sending={r for r in pending if rng.random() < 0.3})
    if rng.random() < 0.1:
        blocks = [b for bl in s.kv.req_to_blocks.values() for b in bl]
        if blocks:
            reports["invalid_block_ids"] = {rng.choice(blocks).block_id}
    return reports


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workload_keeps_invariants_and_drains(seed: int, policy: str) -> None:
    import random

    rng = random.Random(seed)
    matches = {f"r{i}": [rng.choice([(0, False), (None, False), (8, True), (4, False)])] for i in range(40)}
    conn = ScriptedConnector(matches, delay_free=rng.random() < 0.5,
                             failure_policy=rng.choice(["fail", "recompute"]))
    s = make(num_blocks=rng.randint(12, 24), block_size=rng.choice([1, 2, 4]), budget=rng.choice([4, 16, 64]),
             max_num_seqs=rng.randint(1, 6), max_model_len=48, chunked=rng.random() < 0.8, connector=conn,
             policy=policy)
    runner = FakeRunner(s, lambda: rng.choice([EOS] + [5, 6, 7] * 4))
    prefixes = [[rng.randrange(3, 50) for _ in range(12)] for _ in range(3)]
    outputs: dict[str, list[int]] = {}
    added = 0
    for _ in range(3000):
        if added < 40 and rng.random() < 0.3:
            prompt = rng.choice(prefixes)[: rng.randint(1, 12)] + [rng.randrange(3, 50) for _ in range(rng.randint(0, 8))]
            prio = rng.randint(-2, 2) if policy == "priority" else 0
            s.add_request(Request(f"r{added}", prompt, SamplingParams(max_tokens=rng.randint(1, 12), priority=prio),
                                  eos_token_ids=(EOS,)))
            added += 1
        if s.requests and rng.random() < 0.05:
            s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
        so = s.schedule()
        for o in s.update(so, runner.execute(so, **_random_reports(s, rng))):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        _check_invariants(s)
        if policy == "priority":  # the running batch in (priority, arrival) order: its tail goes first
            keys = [(r.sampling_params.priority, r.arrival_time) for r in s.running]
            assert keys == sorted(keys)
        for rid, st in runner.state.items():  # what the client saw is what the runner computed
            if rid in s.requests and s.requests[rid].status == RequestStatus.RUNNING:
                assert s.requests[rid].all_token_ids == st["tokens"]
                assert outputs.get(rid, []) == s.requests[rid].output_token_ids
        if added == 40 and not s.has_unfinished_requests():
            break
    assert added == 40 and not s.has_unfinished_requests(), s.get_stats()
    assert_no_leaks(s)
