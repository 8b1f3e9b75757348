"""A p2p_ec producer in its own process (killed by the tests): it reads {options, fingerprint,
mm_hash} as one JSON line on stdin, reserves the item (PENDING: it never finishes encoding), prints
{"address", "public_key"} and serves until killed or stdin closes."""

from __future__ import annotations

import json
import sys

from pdcluster.connectors.ec.options import ECOptions
from pdcluster.connectors.ec.producer import ECProducer
from pdcluster.connectors.ec.server import ECControlServer


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    opts = ECOptions.from_dict(spec["options"])
    producer = ECProducer(opts, spec["fingerprint"])
    server = ECControlServer(producer, opts)
    producer.store.reserve(spec["mm_hash"])
    print(json.dumps({"address": server.address, "public_key": opts.keypair.public.decode()}), flush=True)
    sys.stdin.read()  # until the parent closes stdin (or kills us)
    server.close()
    producer.close()


if __name__ == "__main__":
    main()
