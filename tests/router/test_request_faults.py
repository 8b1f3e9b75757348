"""A request whose own constraints leave no token to sample part way, through the router: a
grammar that a word-level vocabulary can begin but not continue (its tokens carry no space).
The worker ends it naming the field; the router answers 400 under the client's field name (a
stream: the text the grammar allowed, then an error event) and does not migrate it, since
another worker would reach the same point. The worker serves the next request."""

from __future__ import annotations

import http.client
import json

from real_router_cluster import WorkerProc, router_cluster


def _post(c, path: str, body: dict) -> tuple[int, str]:
    host, port = c.http_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, raw


def test_a_grammar_the_vocabulary_cannot_continue_is_a_400_naming_the_field(loop_thread, key_dir, tmp_path):
    from tiny_models import make_tiny_checkpoint

    model = str(make_tiny_checkpoint("llama", tmp_path / "w"))
    args = ["--role", "both", "--model", model, "--max-model-len", "128", "--num-kv-blocks", "64",
            "--key-dir", str(key_dir), "--log-level", "WARNING"]
    worker = WorkerProc("wordlevel", args, tmp_path / "logs")
    try:
        worker.wait_ready()
        c = router_cluster(loop_thread, [worker], model, request_timeout_s=60.0)
        try:
            assert c.wait_healthy(1)
            word = "t7"  # no shorter token spells a prefix of it ("t" is none): the grammar's only way
            for field in ("structured_outputs", "guided_regex"):
                spec = {"regex": f"{word}( {word})+"} if field == "structured_outputs" else f"{word}( {word})+"
                code, raw = _post(c, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 8, field: spec})
                err = json.loads(raw)["error"]
                assert code == 400 and err["param"] == field, raw
                assert "the grammar allows no token of this model's vocabulary after 1 output tokens" in err["message"]
            code, raw = _post(c, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 8, "stream": True,
                                                     "guided_regex": f"{word}( {word})+"})
            events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
            assert code == 200 and "".join(e["choices"][0]["text"] for e in events if "choices" in e).strip() == word
            assert events[-1]["error"]["code"] == 400 and events[-1]["error"]["param"] == "guided_regex", events[-1]
            assert sum(c.metric("pdcluster_router_migrations_total", {"reason": r})
                       for r in ("worker_error", "worker_lost", "worker_busy", "stalled")) == 0
            code, raw = _post(c, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 4, "guided_choice": [word]})
            assert code == 200 and json.loads(raw)["choices"][0]["text"].strip() == word, raw
            assert json.loads(raw)["choices"][0]["finish_reason"] == "stop", raw
        finally:
            c.close()
    finally:
        worker.terminate()
        worker.stop()


def test_a_prefill_leg_that_failed_itself_is_a_400_naming_the_field():
    """A disaggregated request's prefill leg that ends with the request's own fault is the same
    400 (no decode leg follows); any other failed prefill leg stays the cluster's 500."""
    import grpc
    import pytest

    from pdcluster._proto import common_pb2, worker_pb2
    from pdcluster.router.errors import RouterError
    from pdcluster.router.legs import check_prefill

    own = worker_pb2.WorkerGenerateResponse(finished=True, finish_reason=common_pb2.FINISH_REASON_ERROR,
                                            error_message="structured_outputs: the grammar allows no token",
                                            error_field="structured_outputs")
    with pytest.raises(RouterError) as e:
        check_prefill(own)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.field == "structured_outputs"
    assert e.value.http_status == 400
    own.error_field = ""
    with pytest.raises(RouterError) as e:
        check_prefill(own)
    assert e.value.code == grpc.StatusCode.INTERNAL and e.value.http_status == 500
