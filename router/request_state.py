"""RequestState: what the router tracks about one client request while it runs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from pdcluster._proto import router_pb2

from .preprocess import PreparedRequest
from .registry import WorkerHandle


@dataclass(eq=False)
class RequestState:
    prep: PreparedRequest
    frontend: str  # "grpc" | "http": a metric label
    route: router_pb2.RouteInfo = field(default_factory=router_pb2.RouteInfo)
    # Every worker a leg was sent to (cancellation aborts on all of them, finished legs included:
    # a prefill worker may still hold the prompt's blocks under a transfer lease).
    touched: dict[str, WorkerHandle] = field(default_factory=dict)
    active_calls: dict[str, grpc.aio.UnaryStreamCall] = field(default_factory=dict)
    block_hashes: list[bytes] | None = None  # computed once, for prefix-aware picks
    sent_to_client: bool = False  # once True, no retry may happen (the client has output)
    finished_cleanly: bool = False
    aborted: bool = False  # by the Router.Abort RPC
    first_token_time: float = 0.0  # Unix time
    last_token_at: float = 0.0  # monotonic, for ITL
    num_generated: int = 0
    # What the client was sent, so a migration resumes right after it (router/migration.py).
    output_token_ids: list[int] = field(default_factory=list)
    failed_workers: set[str] = field(default_factory=set)  # addresses a leg of this request died on
    num_migrations: int = 0
    stalled: str | None = None  # address of a worker whose leg the stall watch cancelled
    status: str = "OK"  # gRPC code name of the outcome, a metric label
    # Multimodal requests (router/ec_stage.py): sha256 of each image's bytes, the EC params every
    # leg carries (proto EcTransferParams), and the address each leg ran on (to record what a
    # prefill leg now holds for others).
    image_keys: list[str] = field(default_factory=list)
    ec_params: list = field(default_factory=list)
    leg_address: dict[str, str] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.prep.request_id

    def touch(self, handle: WorkerHandle, call: grpc.aio.UnaryStreamCall) -> None:
        self.touched[handle.address] = handle
        self.active_calls[handle.address] = call

    def mark_first_token(self) -> None:
        self.first_token_time = time.time()
