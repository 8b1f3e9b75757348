"""router/disagg_rule.py: when a request is disaggregated (pure; milliseconds)."""

from __future__ import annotations

import pytest

from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.router.config import RouterConfig
from pdcluster.router.disagg_rule import BACKLOG, REMOTE, SHORT, DisaggRule
from pdcluster.router.legs import prefill_tokens


def test_defaults_always_disaggregate():
    rule = DisaggRule()
    assert rule.choose(0, [0], [0]) == REMOTE
    assert rule.choose(5000, [10**6], [0]) == REMOTE  # no backlog limit: the prefill pool always takes it


def test_short_prompts_stay_on_the_decode_worker():
    rule = DisaggRule(min_uncached_tokens=256)
    assert rule.choose(256, [0], [0]) == SHORT
    assert rule.choose(0, [0], [0]) == SHORT
    assert rule.choose(257, [0], [0]) == REMOTE


def test_backlog_sends_work_back_only_while_the_prefill_pool_is_behind():
    rule = DisaggRule(max_prefill_backlog_tokens=512)
    assert rule.choose(100, [512], [0]) == REMOTE          # at the limit: still the prefill pool's
    assert rule.choose(100, [513], [0]) == BACKLOG         # over it, an idle decode worker is done first
    assert rule.choose(100, [513, 100], [0]) == REMOTE     # the least busy prefill worker is what counts
    # The decode worker takes it only if it would be done before the prefill worker could start it:
    assert rule.choose(400, [1000], [599]) == BACKLOG      # 599 + 400 < 1000
    assert rule.choose(400, [1000], [600]) == REMOTE       # 600 + 400 = 1000
    assert rule.choose(900, [513], [0]) == REMOTE          # a long prompt waits for the prefill pool
    assert rule.choose(900, [2000], [5000, 1000]) == BACKLOG  # the least busy decode worker counts
    # Both rules: a short prompt is SHORT whatever the backlog.
    both = DisaggRule(min_uncached_tokens=64, max_prefill_backlog_tokens=512)
    assert both.choose(64, [0], [0]) == SHORT
    assert both.choose(65, [600], [0]) == BACKLOG
    assert both.choose(65, [0], [0]) == REMOTE


def test_backlog_rule_limited_to_decode_workers_with_few_requests_in_flight():
    """Each prompt a decode worker computes stalls every decode running there: with
    max_decode_inflight only a decode worker that has at most that many requests takes one."""
    rule = DisaggRule(max_prefill_backlog_tokens=256, max_decode_inflight=1)
    assert rule.choose(100, [600], [0], [0]) == BACKLOG
    assert rule.choose(100, [600], [0], [1]) == BACKLOG
    assert rule.choose(100, [600], [0], [2]) == REMOTE      # two decodes would stall: the prefill pool's
    assert rule.choose(100, [200], [0], [0]) == REMOTE      # the prefill pool keeps up: as without the limit
    # The backlog test counts only the decode workers idle enough, not the pool's least busy:
    assert rule.choose(100, [600], [0, 550], [5, 1]) == REMOTE   # the idle-enough one: 550 + 100 >= 600
    assert rule.choose(100, [600], [0, 400], [5, 1]) == BACKLOG  # 400 + 100 < 600
    strict = DisaggRule(max_prefill_backlog_tokens=256, max_decode_inflight=0)
    assert strict.choose(100, [600], [0], [1]) == REMOTE
    assert strict.choose(100, [600], [0], [0]) == BACKLOG
    # Short prompts are the SHORT rule's, which the limit does not touch:
    both = DisaggRule(min_uncached_tokens=64, max_prefill_backlog_tokens=256, max_decode_inflight=0)
    assert both.choose(64, [0], [0], [9]) == SHORT


def test_decode_inflight_limit_is_checked_by_name():
    with pytest.raises(ValueError, match="max_decode_inflight must be >= 0"):
        DisaggRule(max_prefill_backlog_tokens=256, max_decode_inflight=-1)
    with pytest.raises(ValueError, match="needs max_prefill_backlog_tokens > 0"):
        DisaggRule(max_decode_inflight=1)  # it limits the backlog rule: alone it would do nothing
    with pytest.raises(ValueError, match="disagg_max_decode_inflight must be >= 0"):
        RouterConfig(disagg_max_prefill_backlog_tokens=256, disagg_max_decode_inflight=-1)
    with pytest.raises(ValueError, match="disagg_max_decode_inflight .*needs disagg_max_prefill_backlog_tokens"):
        RouterConfig(disagg_max_decode_inflight=0)
    assert RouterConfig(disagg_max_prefill_backlog_tokens=256, disagg_max_decode_inflight=0).disagg_max_decode_inflight == 0


@pytest.mark.parametrize("field", ["min_uncached_tokens", "max_prefill_backlog_tokens"])
def test_negative_limits_are_refused_by_name(field):
    with pytest.raises(ValueError, match=field):
        DisaggRule(**{field: -1})
    with pytest.raises(ValueError, match=f"disagg_{field}"):
        RouterConfig(**{f"disagg_{field}": -1})


def test_prefill_tokens_of_a_leg():
    prompt = list(range(40))
    plain = worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=prompt)
    assert prefill_tokens(plain) == 40
    prefill = worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=prompt,
                                               kv_transfer_params=common_pb2.KvTransferParams(do_remote_decode=True))
    assert prefill_tokens(prefill) == 40
    resumed = worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=prompt, prefill_output_token_ids=[1, 2])
    assert prefill_tokens(resumed) == 42  # a migrated request's worker computes its output so far too
    loads = worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=prompt, prefill_output_token_ids=[1],
                                             kv_transfer_params=common_pb2.KvTransferParams(do_remote_prefill=True))
    assert prefill_tokens(loads) == 0
    waits = worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=prompt, await_kv_transfer_id="ab" * 16)
    assert prefill_tokens(waits) == 0
