"""`pdcluster bench`: load generators and their metrics.

Importing the package costs only argparse: the CLI registers `add_bench_parser` at startup and
the benchmark modules load when a bench command runs.
"""

from __future__ import annotations

from pdcluster.cluster.bench.cli import add_bench_parser

__all__ = ["add_bench_parser"]
