"""pdcluster.worker: the gRPC service code every worker role shares.

    convert.py          proto <-> engine types (SamplingParams, RequestOutput deltas, KV params)
    options.py          gRPC message-size limits and channel/server options
    tls.py              TLS / mTLS credentials from PEM files
    roles.py            RoleHandler: what a role accepts in kv_transfer_params (aggregated here;
                        producer and consumer in pdcluster.prefill_worker / pdcluster.decode_worker)
    worker_servicer.py  the Worker gRPC servicer over an AsyncEngine
    worker_stats.py     WorkerStats / WorkerInfo from the engine's stats
    kv_events.py        the KV-event publisher task (CURVE ZMQ PUB + snapshot ROUTER)
    health.py           grpc.health.v1 status that follows the engine thread
    server.py           start_worker_server(): wires everything into one grpc.aio server

Nothing is imported here, so `import pdcluster.client` (which uses convert/options/tls) stays
free of torch and zmq.
"""
