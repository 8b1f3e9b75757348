from __future__ import annotations

import pytest

from pdcluster.cluster.bench.goodput import meets_slos, parse_goodput


def test_parse() -> None:
    assert parse_goodput(["ttft:200", "TPOT:50.5", "e2el:0"]) == {"ttft": 200.0, "tpot": 50.5, "e2el": 0.0}
    assert parse_goodput(None) == {}


@pytest.mark.parametrize("item", ["ttft", "itl:5", "ttft:abc", "ttft:-1", "ttft:inf", "ttft:nan"])
def test_parse_rejects(item: str) -> None:
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput([item])


def test_meets_every_slo_given() -> None:
    assert meets_slos({"ttft": 200}, ttft_s=0.2, tpot_s=9.0, e2el_s=9.0)  # on the line is good
    assert not meets_slos({"ttft": 200, "e2el": 1000}, ttft_s=0.1, tpot_s=0.0, e2el_s=1.5)
    assert meets_slos({}, 1.0, 1.0, 1.0)
