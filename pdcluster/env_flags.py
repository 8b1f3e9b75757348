"""On/off switches read from the environment, one spelling for every knob."""

from __future__ import annotations

import os

_OFF = ("0", "false", "off", "no")


def env_enabled(name: str, default: bool = True) -> bool:
    """False when `name` is set to 0 / false / off / no (any case), True when set to anything
    else, `default` when unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in _OFF
