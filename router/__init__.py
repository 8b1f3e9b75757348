"""pdcluster.router: the cluster's front door (gRPC Router service + OpenAI-compatible HTTP).

    app.py            Router: wires everything below onto one event loop; start() / stop()
    config.py         RouterConfig (frozen, validated)
    server.py         gRPC frontend: Router service (Generate, Abort, ListWorkers) + health
    http_server.py    OpenAI HTTP frontend (/v1/completions, /v1/chat/completions, /v1/models,
                      /health, /metrics); openai_protocol.py parses bodies into GenerateRequests,
                      openai_responses.py shapes answers and SSE chunks
    preprocess.py     validation + tokenization + chat templates, shared by both frontends
    orchestrator.py   one request's life: admission, aggregated or prefill->decode flow, abort
    legs.py           one leg on one pool: pick, call, retry before the first token
    registry.py       workers: health probes, Stats, circuit breakers (circuit_breaker.py)
    policies.py       pure routing policies; prefix_index.py + kv_events.py + kv_sync.py keep
                      the prefix index fed from the workers' CURVE KV-event streams
    metrics.py        Prometheus metrics in a per-router CollectorRegistry

Nothing here imports torch (checked by tests/router/test_router_e2e.py with -X importtime).
"""
