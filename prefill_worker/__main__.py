"""`python -m pdcluster.prefill_worker [flags]`: one prefill worker (`pdcluster serve-worker --role prefill`)."""

from __future__ import annotations

import sys

from pdcluster.cluster.worker_cmd import main

if __name__ == "__main__":
    sys.exit(main(role="prefill", prog="python -m pdcluster.prefill_worker"))
