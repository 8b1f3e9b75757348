"""Metrics against values worked out by hand (see the comments)."""

from __future__ import annotations

import math

import pytest

from pdcluster.cluster.bench.metrics import compute_metrics, max_concurrency_observed
from pdcluster.cluster.bench.request import RequestResult


def _results() -> list[RequestResult]:
    return [
        # 4 tokens in 4 chunks: TPOT = (0.3 - 0.1) / 3
        RequestResult(prompt_len=10, success=True, output_len=4, ttft=0.1, itl=[0.05, 0.05, 0.1], latency=0.3,
                      start_time=100.0, generated_text=" a b c d"),
        # 1 token: no TPOT sample (0 for goodput)
        RequestResult(prompt_len=20, success=True, output_len=1, ttft=0.2, latency=0.2, start_time=100.05),
        # no usage from the server: the text is counted (2 words -> 2 tokens); TPOT = 0.1 / 1
        RequestResult(prompt_len=30, success=True, output_len=None, ttft=0.3, itl=[0.1], latency=0.4,
                      start_time=100.1, generated_text="x y"),
        RequestResult(prompt_len=40, success=False, latency=0.05, start_time=100.2, error="HTTP 500"),
    ]


def _words(text: str) -> int:
    return len(text.split())


def test_hand_checked_summary() -> None:
    m = compute_metrics(_results(), duration=2.0, percentiles=[50, 99], count_tokens=_words)
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input == 60  # failed requests' prompts do not count
    assert m.total_output == 7 and m.output_lens == (4, 1, 2, 0)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(33.5)
    assert m.request_goodput is None

    # TTFT [100, 200, 300] ms; std is the population std; p99 interpolates 200 + 0.98 * 100
    assert (m.ttft.mean, m.ttft.median) == pytest.approx((200.0, 200.0))
    assert m.ttft.std == pytest.approx(math.sqrt(20000 / 3))
    assert dict(m.ttft.percentiles) == pytest.approx({50.0: 200.0, 99.0: 298.0})
    # TPOT [66.67, 100] ms
    assert m.tpot.mean == pytest.approx(250 / 3)
    assert m.tpot.std == pytest.approx(50 / 3)
    assert dict(m.tpot.percentiles)[99.0] == pytest.approx(200 / 3 + 0.99 * 100 / 3)
    # ITL pools every gap: [50, 50, 100, 100] ms
    assert (m.itl.mean, m.itl.median, m.itl.std) == pytest.approx((75.0, 75.0, 25.0))
    assert dict(m.itl.percentiles)[99.0] == pytest.approx(100.0)
    # E2EL [300, 200, 400] ms
    assert (m.e2el.mean, m.e2el.median) == pytest.approx((300.0, 300.0))

    assert m.max_concurrent_requests == 4  # all four are in flight at t = 100.2
    assert m.max_output_tokens_per_s == pytest.approx(7.0)  # every token lands in the first second


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 250}, 2),
    ({"tpot": 70}, 2),  # the one-token request has TPOT 0 and meets it
    ({"ttft": 200, "tpot": 70}, 2),  # exactly on the SLO meets it
    ({"e2el": 300}, 2),
    ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 3),
    ({"ttft": 50}, 0),
])
def test_goodput(slos: dict[str, float], good: int) -> None:
    m = compute_metrics(_results(), duration=2.0, percentiles=[99], slos_ms=slos, count_tokens=_words)
    assert m.request_goodput == pytest.approx(good / 2.0)


def test_without_a_token_counter_chunks_are_counted() -> None:
    m = compute_metrics(_results(), duration=1.0, percentiles=[99])
    assert m.output_lens == (4, 1, 2, 0)  # request 3: 1 + len(itl) chunks


def test_all_failed_gives_zeros_not_errors() -> None:
    m = compute_metrics([RequestResult(error="refused", start_time=5.0, latency=0.01)], 1.0, [99], {"ttft": 1})
    assert (m.completed, m.failed, m.total_output, m.request_goodput) == (0, 1, 0, 0.0)
    assert m.ttft.mean == 0.0 and m.ttft.percentiles == ((99.0, 0.0),)
    assert m.max_output_tokens_per_s == 0.0


def test_concurrency_sweep_touching_intervals_do_not_overlap() -> None:
    rs = [RequestResult(start_time=1.0, latency=1.0), RequestResult(start_time=2.0, latency=1.0),
          RequestResult(start_time=2.5, latency=0.1)]
    assert max_concurrency_observed(rs) == 2


def test_invalid_duration() -> None:
    with pytest.raises(ValueError):
        compute_metrics([], 0.0, [99])
