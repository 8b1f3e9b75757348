"""The model runner's side of the KV connector: when each worker-side method is called, and how
completion is counted across tensor-parallel ranks.

One step on one rank (ModelRunner.execute):

    start_load_kv(meta)                         always, even on an empty step (async loads start)
    for layer i:  wait_for_layer_load(i)        forward pre-hook of layer i
                  ... layer i writes its KV ...
                  save_kv_layer(i, kv[i], meta) forward hook of layer i
    wait_for_save()                             after the forward (only when there was one)
    get_finished(), get_failed_blocks()         -> this rank's report -> TransferCompletion

Models without a `model.layers` list get the per-layer calls at whole-model granularity (every
wait before the forward, every save after it), which is correct, only less overlapped.

Completion is counted, not assumed from rank 0: a request id reaches the scheduler in
finished_sending / finished_recving only once every one of `world_size` ranks reported it; a
failed block is reported as soon as any rank fails it (one bad shard spoils the block).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pdcluster.engine.kv_connector import KVCacheLayout, KVConnectorBase
from pdcluster.engine.outputs import ModelRunnerOutput


class TransferCompletion:
    """Per-request completion counts over TP ranks. Each rank reports an id at most once per kind
    (the connector contract); the id is released when the count reaches world_size."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}")
        self.world_size = world_size
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed: set[int] = set()

    def add(self, rank: int, finished_sending: set[str], finished_recving: set[str],
            failed_blocks: set[int]) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        _count(self._sending, self._done_sending, finished_sending, self.world_size)
        _count(self._recving, self._done_recving, finished_recving, self.world_size)
        self._failed |= failed_blocks

    def take(self) -> tuple[set[str], set[str], set[int]]:
        """(finished_sending, finished_recving, failed block ids) complete since the last take."""
        out = (self._done_sending, self._done_recving, self._failed)
        self._done_sending, self._done_recving, self._failed = set(), set(), set()
        return out


def _count(counts: Counter[str], done: set[str], ids: set[str], world_size: int) -> None:
    for request_id in ids:
        counts[request_id] += 1
        if counts[request_id] >= world_size:
            del counts[request_id]
            done.add(request_id)


class ConnectorHooks:
    """Drives one rank's worker-side connector from the model runner."""

    def __init__(self, connector: KVConnectorBase, rank: int = 0, world_size: int = 1) -> None:
        self.connector = connector
        self.rank = rank
        self.completion = TransferCompletion(world_size)
        self._meta: Any = None
        # This rank's own report of the last step (sending, recving, failed blocks): a TP rank > 0
        # sends it to the driver, which counts it with add_remote.
        self.last_report: tuple[set[str], set[str], set[int]] = (set(), set(), set())
        self._kv_caches: Any = None
        self._per_layer = False
        self._num_layers = 0

    def register(self, kv_caches: Any, layout: KVCacheLayout, model: Any) -> None:
        self._kv_caches = kv_caches
        self._num_layers = layout.num_layers
        self.connector.register_kv_caches(kv_caches, layout)
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is not None and len(layers) == layout.num_layers:
            for i, layer in enumerate(layers):
                layer.register_forward_pre_hook(self._pre_hook(i))
                layer.register_forward_hook(self._post_hook(i))
            self._per_layer = True

    # Both hooks read neither the layer's inputs nor its output (args_free): the one-call decode
    # step (models/cpu_decode_step.py) may then run every layer's pre-hook before its call and every
    # post-hook after it, in layer order; a hook without the mark makes it run the eager layers.
    def _pre_hook(self, i: int) -> Any:
        def hook(_module: Any, _args: Any) -> None:
            self.connector.wait_for_layer_load(i)
        hook.args_free = True  # type: ignore[attr-defined]
        return hook

    def _post_hook(self, i: int) -> Any:
        def hook(_module: Any, _args: Any, _out: Any) -> None:
            self.connector.save_kv_layer(i, self._kv_caches[i], self._meta)
        hook.args_free = True  # type: ignore[attr-defined]
        return hook

    # -- one step --------------------------------------------------------------------------------
    def start(self, meta: Any) -> None:
        self._meta = meta
        self.connector.start_load_kv(meta)

    def before_forward(self) -> None:
        if not self._per_layer:
            for i in range(self._num_layers):
                self.connector.wait_for_layer_load(i)

    def after_forward(self) -> None:
        if not self._per_layer:
            for i in range(self._num_layers):
                self.connector.save_kv_layer(i, self._kv_caches[i], self._meta)
        self.connector.wait_for_save()

    def finish(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """This rank's report into the completion count; what every rank finished into `out`.
        With TP the driver rank adds the other ranks' reports (add_remote) before this call."""
        sending, recving = self.connector.get_finished()
        self.last_report = (set(sending), set(recving), set(self.connector.get_failed_blocks()))
        self.completion.add(self.rank, *self.last_report)
        return self.merge_completed(out)

    def merge_completed(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """Move what every rank has now finished into `out`."""
        done_sending, done_recving, failed = self.completion.take()
        out.finished_sending |= done_sending
        out.finished_recving |= done_recving
        out.invalid_block_ids |= failed
        self._meta = None
        return out

    def add_remote(self, rank: int, finished_sending: set[str], finished_recving: set[str],
                   failed_blocks: set[int]) -> None:
        """Another rank's report of this step (TP: gathered by the driver)."""
        self.completion.add(rank, finished_sending, finished_recving, failed_blocks)

    def shutdown(self) -> None:
        self.connector.shutdown()
