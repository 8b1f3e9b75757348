"""encode_worker: the encoder-only role of encoder-cache (EC) sharing (answers Worker.Encode).

An encode instance loads only the vision tower and projector (EngineArgs.encoder_only), runs them
on the images the router sends (`Worker.Encode`, images in prompt order), keeps the outputs in its
EC producer under a lease and returns the EcTransferParams the prefill (and decode) legs fetch them
with. It serves no Generate leg: it has no decoder and no KV cache.

Use `EncodeRole` as the `role` of `pdcluster.worker.server.start_worker_server`, or run
`python -m pdcluster.encode_worker` (= `pdcluster serve-worker --role encode`).

    role.py         EncodeRole: refuses every Generate leg (FAILED_PRECONDITION), serves Encode
    spec.py         ROLE: the encode role for the worker core (encoder-only engine, EC connector
                    "p2p_ec" by default; its role metrics), registered in pdcluster.worker.role_registry
    __main__.py     the worker with this role fixed
"""

from __future__ import annotations

from pdcluster.encode_worker.role import EncodeRole

__all__ = ["EncodeRole"]
