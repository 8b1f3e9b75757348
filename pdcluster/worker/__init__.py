"""pdcluster.worker: the worker core every role shares -- one engine behind the Worker gRPC service.

    assembly.py         WorkerConfig -> role + engine (its connector half) + server, until a signal
    role_registry.py    WorkerRole and the registry of roles (both here; prefill, decode in
                        pdcluster.prefill_worker / pdcluster.decode_worker; plugins by entry point)
    roles.py            RoleHandler: what a role accepts in kv_transfer_params (aggregated here)
    server.py           start_worker_server(): servicer + health + KV events in one grpc.aio server
    worker_servicer.py  the Worker gRPC servicer: a thin adapter over the request table
    worker_stream.py    one GenerateStream call: many requests over one gRPC stream
    request_table.py    every running request: checks, pumps, refusals, abort (both paths)
    inflight.py         what is tracked per request (Inflight) and Refusal
    convert.py          engine outputs -> WorkerGenerateResponse
    worker_stats.py     WorkerStats / WorkerInfo from the engine's stats
    kv_events.py        the KV-event publisher task (engine events -> CURVE ZMQ PUB + snapshots)
    kv_events_pub.py    the KV-event wire format and the publisher sockets (routers decode it)
    health.py           grpc.health.v1 status that follows the engine thread
    options.py, tls.py  gRPC message-size limits and channel options; TLS / mTLS credentials

Nothing is imported here, so `import pdcluster.client` (which uses options/tls) stays free of
torch and zmq.
"""
