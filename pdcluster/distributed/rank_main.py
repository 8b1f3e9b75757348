"""Entry point of a non-zero TP rank: `python -m pdcluster.distributed.rank_main`.

    stdin: one bootstrap frame (launcher.py), then kept open by rank 0 until it goes away
    loop:  control message = TPGroup.broadcast_bytes from rank 0
           "step"     -> ModelRunner.execute(SchedulerOutput); its sampled tokens are dropped
                         (rank 0's are the answer; ours are identical and keep our state in step);
                         with a KV connector, then gather(our finished/failed report) to rank 0
           "shutdown" -> release the runner and the groups, exit 0

Any error (a failed collective, a malformed message, a bug) ends the process with a non-zero
code: rank 0 watches its children and takes the whole instance down.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("pdcluster.tp_rank")


def _watch_parent(stop: threading.Event) -> None:
    """Exit as soon as rank 0 closes our stdin (it exited, crashed or was killed)."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    if not stop.is_set():  # rank 0 exited, crashed, or dropped its engine without shutdown()
        log.warning("rank 0 closed our stdin without a shutdown message; exiting")
    os._exit(0 if stop.is_set() else 1)


def run(boot: dict, stop: threading.Event) -> None:
    import importlib

    import msgpack
    import torch

    from pdcluster.distributed.config_codec import engine_config_from_dict
    from pdcluster.distributed.executor import MAX_REPORT_BYTES
    from pdcluster.distributed.group import TPGroup, attach_tp_group, make_store
    from pdcluster.distributed.step_codec import (
        KIND_SHUTDOWN,
        MAX_CONTROL_MESSAGE_BYTES,
        decode_control,
        encode_report,
    )
    from pdcluster.engine.kv_connector import KVConnectorRole
    from pdcluster.engine.model_runner import ModelRunner

    config = engine_config_from_dict(boot["config"])
    rank, world = int(boot["rank"]), int(boot["world_size"])
    timeout_s = float(boot["timeout_s"])
    if config.device == "cuda":
        torch.cuda.set_device(rank)  # one GPU per rank, rank 0 on cuda:0
    store = make_store(boot["host"], int(boot["port"]), world, False, timeout_s)
    group = TPGroup(store, rank, world, config.device, timeout_s)
    connector = None
    if boot.get("connector_factory"):
        module, _, attr = str(boot["connector_factory"]).partition(":")
        factory = getattr(importlib.import_module(module), attr)
        connector = factory(KVConnectorRole.WORKER, config)
    runner = ModelRunner(config, rank=rank, connector=connector)
    attach_tp_group(runner.model, group)
    group.barrier()  # "loaded": rank 0 waits here for every rank before serving
    decoder = connector.metadata_from_dict if connector is not None else None
    if connector is not None:
        group.gather_bytes(msgpack.packb(runner.handshake_metadata(), use_bin_type=True), MAX_REPORT_BYTES)
    while True:
        kind, step = decode_control(group.broadcast_bytes(None, MAX_CONTROL_MESSAGE_BYTES), decoder)
        if kind == KIND_SHUTDOWN:
            stop.set()  # rank 0 closes our stdin next: that EOF is expected now
            break
        assert step is not None
        runner.execute(step)
        hooks = runner.connector_hooks
        if hooks is not None:
            group.gather_bytes(encode_report(*hooks.last_report), MAX_REPORT_BYTES)
    runner.shutdown()
    group.shutdown()


def main() -> int:
    logging.basicConfig(level=os.environ.get("PDCLUSTER_LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdcluster.distributed.launcher import read_frame

    boot = read_frame(sys.stdin.buffer)
    stop = threading.Event()
    threading.Thread(target=_watch_parent, args=(stop,), name="pdcluster-parent-watch", daemon=True).start()
    try:
        run(boot, stop)
    except BaseException:
        log.exception("TP rank %s failed", boot.get("rank"))
        os._exit(1)  # not sys.exit: a daemon thread or a wedged backend must not keep us alive
    stop.set()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
