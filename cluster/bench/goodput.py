"""Goodput: the service level objectives of `--goodput ttft:MS tpot:MS e2el:MS`, and the test of
one request against them. A request is good when it meets every SLO given (vLLM's definition:
a metric equal to its SLO still meets it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS pairs with NAME in {', '.join(SLO_METRICS)}; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms >= 0 or math.isinf(ms):
            raise ValueError(f"--goodput {item!r}: the SLO must be a finite number >= 0")
        slos[name] = ms
    return slos


def meets_slos(slos_ms: dict[str, float], ttft_s: float, tpot_s: float, e2el_s: float) -> bool:
    """`tpot_s` is 0 for a one-token output (it has no inter-token time), as in vLLM."""
    observed = {"ttft": ttft_s, "tpot": tpot_s, "e2el": e2el_s}
    # Compared in seconds, like vLLM, so a value exactly on the SLO rounds the same way.
    return all(slo / 1000.0 >= observed[name] for name, slo in slos_ms.items())
