"""`python -m pdcluster.decode_worker [flags]`: one decode worker (`pdcluster serve-worker --role decode`)."""

from __future__ import annotations

import sys

from pdcluster.cluster.worker_cmd import main

if __name__ == "__main__":
    sys.exit(main(role="decode", prog="python -m pdcluster.decode_worker"))
