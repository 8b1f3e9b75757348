"""`python tests/chaos/mark_hold_cli.py ARGS` is `pdcluster ARGS` with mark_hold installed (marks
from $PDCLUSTER_TEST_HOLD_MARKS): requests whose id starts with mark_hold.PREFIX stop at each mark
until their worker is killed."""

from __future__ import annotations

import os
import runpy
import sys

from mark_hold import install_mark_hold, marks_from_env

if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m pdcluster.cluster.cli` has it, not tests/chaos/
    install_mark_hold(marks_from_env())
    runpy.run_module("pdcluster.cluster.cli", run_name="__main__", alter_sys=True)
