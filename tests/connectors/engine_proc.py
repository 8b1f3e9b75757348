"""A test engine process: one LLMEngine with a KV connector, driven over stdin/stdout.

Frames are 4-byte big-endian length + msgpack (no pickle across processes). The parent plays
the router: it sends requests and reads events.

    parent -> child  {"op": "init", "engine_args": {...}}      -> {"event": "ready", "meta": {...}}
                     {"op": "add", "reqs": [{request_id, prompt, params, kv, prior}, ...]}
                     {"op": "abort", "ids": [...]}
                     {"op": "stats", "tag": t}                 -> {"event": "stats", "tag": t, "stats": {...}}
                     {"op": "stop"}
    child -> parent  {"event": "finished", "request_id", "token_ids", "error", "finish_reason", "kv"}
    (kv both ways: KVTransferParams.to_wire() / from_wire())

stdout carries frames only: everything else the process prints goes to stderr.
"""

from __future__ import annotations

import os
import queue
import struct
import sys
import threading
from typing import Any, BinaryIO

import msgpack

_LEN = struct.Struct("!I")
MAX_FRAME = 64 << 20


def write_frame(out: BinaryIO, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    out.write(_LEN.pack(len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO) -> Any:
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ValueError("frame too large")
    return msgpack.unpackb(inp.read(n), raw=False, max_ext_len=0)


def _serve(out: BinaryIO, cmds: queue.Queue) -> None:
    from pdcluster.config import EngineArgs
    from pdcluster.connectors import engine_connector_factory
    from pdcluster.engine.kv_connector import KVTransferParams
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.sampling_params import SamplingParams

    init = cmds.get()
    args = EngineArgs(**init["engine_args"])
    engine = LLMEngine.from_engine_args(args, connector=engine_connector_factory if args.kv_connector else None)
    write_frame(out, {"event": "ready", "pid": os.getpid(), "meta": engine.core.runner.handshake_metadata(),
                      "tp_pids": list(getattr(engine.core.runner, "pids", {}).values())})
    live: set[str] = set()
    while True:
        try:
            cmd = cmds.get(timeout=0.01) if not engine.has_unfinished_requests() else cmds.get_nowait()
        except queue.Empty:
            cmd = None
        if cmd is not None:
            op = cmd["op"]
            if op == "stop":
                break
            if op == "add":
                for r in cmd["reqs"]:
                    try:
                        kv = KVTransferParams.from_wire(r["kv"]) if r.get("kv") else None
                        req, text = engine.prepare_request(r["prompt"], SamplingParams(**r["params"]),
                                                           r["request_id"], kv, r.get("prior"))
                        engine.add_prepared(req, text)
                        live.add(r["request_id"])
                    except ValueError as e:
                        write_frame(out, {"event": "finished", "request_id": r["request_id"], "token_ids": [],
                                          "error": str(e), "finish_reason": "error", "kv": None})
            elif op == "abort":
                engine.abort(cmd["ids"])
            elif op == "stats":
                write_frame(out, {"event": "stats", "tag": cmd["tag"], "stats": engine.get_stats()})
            continue  # drain every command before stepping
        if engine.has_unfinished_requests():
            try:
                outs = engine.step()
            except Exception as e:  # the instance is down (a TP rank died): every request fails
                for rid in sorted(live):
                    write_frame(out, {"event": "finished", "request_id": rid, "token_ids": [],
                                      "error": f"engine failed: {e}", "finish_reason": "error", "kv": None})
                live.clear()
                while cmds.get()["op"] != "stop":
                    pass
                break
            for o in outs:
                if o.finished:
                    live.discard(o.request_id)
                    final = engine.get_final(o.request_id)
                    write_frame(out, {"event": "finished", "request_id": o.request_id,
                                      "token_ids": final.outputs[0].token_ids, "error": final.error,
                                      "finish_reason": final.outputs[0].finish_reason,
                                      "kv": final.kv_transfer_params.to_wire()
                                      if final.kv_transfer_params is not None else None})
    engine.shutdown()


def main() -> None:
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the frame stream
    cmds: queue.Queue = queue.Queue()

    def reader() -> None:
        while True:
            frame = read_frame(sys.stdin.buffer)
            if frame is None:  # parent gone: stop
                cmds.put({"op": "stop"})
                return
            cmds.put(frame)

    threading.Thread(target=reader, daemon=True).start()
    _serve(out, cmds)


if __name__ == "__main__":
    main()
