"""The KV connector contract: the engine's port for moving KV blocks between engines and stores.

The engine owns this contract; adapters (P2P, store, EC) and out-of-tree plugins implement it and
the worker services hand an instance to the engine, which never imports `connectors/`.

One class, two halves; each engine builds one instance per role:

    SCHEDULER role (engine core process, inside Scheduler; pure bookkeeping, no blocking I/O)
        once, after every rank registered: set_handshake_metadata({rank: worker.handshake_metadata()})
        schedule(): for a request being admitted
            get_num_new_matched_tokens(req, num_local_hits) -> (n | None, is_async)
            ... blocks allocated ...
            update_state_after_alloc(req, block_ids, n)
        end of schedule():   build_connector_meta(scheduler_output) -> SchedulerOutput.kv_connector_metadata
        request finishes:    request_finished(req, block_ids) -> (delay_free, KVTransferParams | None)
        any time:            take_events()

    WORKER role (every TP rank, inside the model runner; moves bytes asynchronously)
        before allocating:   wants_shared_kv_cache()  (True: the cache lives in named shared memory)
        once:                register_kv_caches(kv_caches, layout); handshake_metadata()
        every step:          start_load_kv(meta)              before the forward pass
                             wait_for_layer_load(i)           before layer i's attention
                             save_kv_layer(i, kv_layer, meta) after layer i's attention
                             wait_for_save()                  after the forward pass
                             get_finished(), get_failed_blocks() -> ModelRunnerOutput
        end:                 shutdown()

The hand-off itself is a KVTransferParams (kv_transfer_params.py, re-exported here): a frozen,
validated value with the fields every connector has plus a bounded `extra` map for the rest.

Completion across TP ranks is counted, not assumed: the runner (or the connector) reports a
request in finished_sending / finished_recving only once every rank has finished it.
Tensors are typed `Any` so this module imports without torch.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdcluster.dtypes import ITEMSIZE
from pdcluster.engine.kv_transfer_params import ExtraValue, KVTransferParams

if TYPE_CHECKING:
    from pdcluster.engine.block_pool import KVEvent
    from pdcluster.engine.outputs import SchedulerOutput
    from pdcluster.engine.request import Request


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVTransferFailure(str, enum.Enum):
    """What the scheduler does with a request whose loaded blocks are reported bad."""

    FAIL = "fail"  # finish it with FINISHED_ERROR and a message naming the failure
    RECOMPUTE = "recompute"  # cut num_computed_tokens back to the first bad block; compute the rest


@dataclass
class KVConnectorMetadata:
    """Base of the per-step object the scheduler side builds and every worker rank receives.
    Subclasses must stay plain data (msgpack-serialisable): with TP it is broadcast to the ranks
    as `to_dict()` and rebuilt on every other rank by the connector's `metadata_from_dict`."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data (msgpack-safe) for the TP step broadcast; default: the dataclass fields."""
        import dataclasses

        return dataclasses.asdict(self)


@dataclass(frozen=True)
class KVCacheLayout:
    """The local paged KV cache as the worker side sees it.

    layout "NHD": each layer's tensor is (2, num_blocks, block_size, num_kv_heads, head_dim),
    K at [0] and V at [1]; a block is contiguous per layer and per K/V.
    Heads are this rank's slice of total_num_kv_heads (replicated when tp_size > total heads).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # local to this rank
    head_dim: int
    dtype: str
    tp_rank: int = 0
    tp_size: int = 1
    total_num_kv_heads: int | None = None  # None: num_kv_heads * tp_size (no replication)
    layout: str = "NHD"
    # Name of the shared-memory segment (pdcluster.transfer.open_shared_region) holding this rank's
    # whole cache as one (num_layers, *layer_shape) tensor, or None for private memory.
    shm_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheLayout.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside [0, tp_size={self.tp_size})")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"KVCacheLayout.dtype must be one of {sorted(ITEMSIZE)}, got {self.dtype!r}")
        if self.layout != "NHD":
            raise ValueError(f"KVCacheLayout.layout must be 'NHD', got {self.layout!r}")
        if self.total_num_kv_heads is None:
            object.__setattr__(self, "total_num_kv_heads", self.num_kv_heads * self.tp_size)
        if self.num_kv_heads != max(1, self.total_heads // self.tp_size):
            raise ValueError(f"num_kv_heads={self.num_kv_heads} is not this rank's share of "
                             f"{self.total_heads} heads over tp_size={self.tp_size}")

    @property
    def total_heads(self) -> int:
        assert self.total_num_kv_heads is not None  # set in __post_init__
        return self.total_num_kv_heads

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's K (or V) in one layer on this rank."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    def global_head_range(self) -> tuple[int, int]:
        """[start, end) of the global KV heads this rank holds."""
        if self.total_heads >= self.tp_size:
            start = self.tp_rank * self.num_kv_heads
            return start, start + self.num_kv_heads
        head = self.tp_rank * self.total_heads // self.tp_size  # replicated: ranks share a head
        return head, head + 1


class KVConnectorBase(ABC):
    """A KV connector. Implement every abstract method; the others have safe defaults.

    Guarantees the scheduler gives: calls happen on one thread, in the order documented per
    method; block ids passed in stay allocated to the request until request_finished returns
    delay_free=False, or, after delay_free=True, until the worker side reports the request in
    finished_sending. What the scheduler expects: see each method.
    """

    # Options a deployment (`pdcluster serve-worker`, `serve`, `up`) fills in for this connector,
    # if it takes them and the operator did not set them: "keys_dir"/"key_name" (the worker's
    # CURVE key pair), "engine_id" (the worker id). A connector with strict option checking lists
    # only what it understands, so it never receives another connector's settings.
    deployment_options: frozenset[str] = frozenset()
    # True when the connector works with blocks behind a sliding window freed (placeholders, id 0,
    # in the block ids it is given, before the window of the tokens computed): it must then never
    # read or write those. False (the default) keeps every block of every request (e.g. a store
    # save reads them all).
    frees_behind_window: bool = False

    def __init__(self, role: KVConnectorRole,
                 failure_policy: KVTransferFailure | str = KVTransferFailure.FAIL) -> None:
        self.role = role
        self.failure_policy = KVTransferFailure(failure_policy)

    # == scheduler side ===========================================================================
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens after the first num_computed_tokens (local prefix hits) the connector can
        supply. Called by Scheduler.schedule() when it considers admitting a waiting request,
        possibly on several steps for one request (until admitted).

        Returns (num_tokens, is_async). num_tokens None: not known yet, ask again next step; the
        call must then not change any state. is_async True: the load runs across steps: the request
        waits in WAITING_FOR_REMOTE_KV until the worker side reports it in finished_recving.
        is_async False: the load completes inside the next forward pass (start_load_kv /
        wait_for_layer_load). The scheduler never takes the last token: one is always computed.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Called by schedule() right after blocks were allocated for an admitted request (also with
        num_external_tokens == 0). block_ids is the request's whole block table; the external
        tokens occupy the token positions [num_computed_tokens, num_computed_tokens + n)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Called once at the end of every schedule(), even an empty one: everything the worker
        side must do this step (loads to start, blocks to save). Resets per-step state."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        """Called once when a request finishes (any reason, including abort and error), before its
        blocks are freed. Returns (delay_free, kv_transfer_params): delay_free True keeps the
        blocks until the worker side reports the request in finished_sending (a consumer's "done"
        or lease expiry: the connector must report it eventually); kv_transfer_params (built from
        request.kv_transfer_params and the connector's own state) is returned to the client with
        the final output. A request finished while WAITING_FOR_REMOTE_KV keeps
        its blocks until finished_recving reports it: cancel the load and report it.
        A request that carried kv_transfer_params but was never queued (refused at admission, or
        its caller went away before the engine took it) is reported too, with no blocks and
        without any earlier call: a consumer lets its producer's hand-off go here."""
        return False, None

    def abort_held(self, request_id: str) -> None:
        """Called when a finished request whose blocks the connector still holds (delay_free) is
        aborted: nobody will take the hand-off (e.g. the client cancelled before its decode leg).
        Release it early if possible; the request must still be reported in finished_sending
        (now or when the hold ends anyway). Default: nothing, the hold runs its course."""
        return None

    def take_events(self) -> list[KVEvent]:
        """KV events (stored/removed) for blocks the connector holds outside the engine's cache."""
        return []

    def set_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Called once by the engine after every worker rank registered its cache: rank ->
        that rank's handshake_metadata(). What a producer's request_finished puts in its params
        (addresses, keys, epoch) comes from here, never from request data."""
        return None

    def metadata_from_dict(self, d: dict[str, Any]) -> KVConnectorMetadata:
        """Rebuild what build_connector_meta returned from its to_dict() (TP ranks > 0 receive
        the step's metadata this way). A connector that does not override this cannot run with
        tensor_parallel_size > 1."""
        raise NotImplementedError(f"{type(self).__name__} does not implement metadata_from_dict: it cannot "
                                  "run with tensor_parallel_size > 1")

    @classmethod
    def supports_tensor_parallel(cls) -> bool:
        return cls.metadata_from_dict is not KVConnectorBase.metadata_from_dict

    def get_stats(self) -> dict[str, Any]:
        """Counters for the engine's stats (transfers, bytes, leases, refusals); plain data."""
        return {}

    # == worker side ==============================================================================
    def wants_shared_kv_cache(self) -> bool:
        """Asked by the model runner before it allocates the cache: True puts the whole cache in
        one named shared-memory segment (CPU caches only) so same-host peers can map it;
        layout.shm_name then names it."""
        return False

    @abstractmethod
    def register_kv_caches(self, kv_caches: Any, layout: KVCacheLayout) -> None:
        """Called once by the model runner after it allocated the paged cache: kv_caches[i] is
        layer i's tensor, shaped layout.layer_shape. Register memory for transfers here.
        The runner passes its one (num_layers, *layer_shape) tensor, so kv_caches is also the
        whole cache as a single contiguous buffer."""

    def handshake_metadata(self) -> Any:
        """Plain data a peer needs to reach this rank (after register_kv_caches); None if none."""
        return None

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Called by the runner before each forward pass: start the loads meta asks for (async)."""

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Called before layer `layer` reads its KV: block until that layer's synchronous loads
        landed (no-op for asynchronous loads, which finish between steps)."""

    @abstractmethod
    def save_kv_layer(self, layer: int, kv_layer: Any, meta: KVConnectorMetadata) -> None:
        """Called after layer `layer` wrote this step's KV: start saving what meta asks for. Must
        not block the forward pass."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Called after the forward pass: block until the saves whose source blocks may be
        overwritten by the next step have been copied out."""

    @abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """Called by the runner after every step. Returns (finished_sending, finished_recving):
        request ids whose blocks the connector no longer reads (producer side: may be freed) and
        whose loads completed, failed or were cancelled (consumer side). Each id is reported once,
        and only after every TP rank finished it."""

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """Called once by the engine after the runner registered the cache: call wake() (from any
        thread; cheap, never blocks) when an asynchronous load or send ends, so an engine that is
        idle with only transfers in flight collects it from get_finished now, not at its next poll
        (up to 1 ms later). Default: ignored, the engine polls."""
        return None

    def get_failed_blocks(self) -> set[int]:
        """Block ids whose load failed since the last call (reported once each). The scheduler
        applies failure_policy to every request holding one of them."""
        return set()

    def shutdown(self) -> None:
        """Release transfer resources; called once, after the last step."""
        return None


__all__ = ["ExtraValue", "KVCacheLayout", "KVConnectorBase", "KVConnectorMetadata", "KVConnectorRole",
           "KVTransferFailure", "KVTransferParams"]
