"""`python tests/held_cli.py ARGS` is `pdcluster ARGS` with engine_hold's prefix hold installed:
a request whose id starts with engine_hold.HOLD_PREFIX stops after its first HOLD_AFTER outputs
until it is ended from outside (cancel, deadline, abort, shutdown), however fast the machine is."""

from __future__ import annotations

import os
import runpy
import sys

from engine_hold import install_prefix_hold

if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m pdcluster.cluster.cli` has it, not tests/
    install_prefix_hold()
    runpy.run_module("pdcluster.cluster.cli", run_name="__main__", alter_sys=True)
