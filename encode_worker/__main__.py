"""`python -m pdcluster.encode_worker [flags]`: one encode worker (`pdcluster serve-worker --role encode`)."""

from __future__ import annotations

import sys

from pdcluster.cluster.worker_cmd import main

if __name__ == "__main__":
    sys.exit(main(role="encode", prog="python -m pdcluster.encode_worker"))
