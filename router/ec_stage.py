"""EcStage: the encoder step of a multimodal request, and encoder-output sharing between legs.

    E -> P -> D   with encode workers: before the first leg, Worker.Encode on the encoder that
                  already encoded these images (EcDirectory affinity), else the least loaded one;
                  its EcTransferParams ride on every leg that computes the prompt (prefill,
                  aggregated, a decode leg without a KV hand-off, a migration resume) in
                  WorkerGenerateRequest.ec_transfer_params.
    P <-> P       without them (or besides them): the final response of a leg that encoded images
                  carries what its worker now holds (WorkerGenerateResponse.ec_transfer_params);
                  the directory keeps it per image, and the next request with the same image
                  gets it attached, so another prefill worker fetches instead of encoding.
    text-only     nothing here runs (the orchestrator's fast path is untouched).

Failures never fail the request: an encoder that is killed, times out or refuses goes on the
books (UNAVAILABLE ejects it, as for legs) and the request goes on without its params; the legs
still carry the images (the router keeps the media until the request ends), so P encodes
locally, and so does any worker a migration resumes the request on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from pdcluster._proto import worker_pb2
from pdcluster.engine.ec_transfer_params import MAX_EC_PRODUCERS
from pdcluster.proto_convert import ec_params_from_proto

from .config import RouterConfig
from .ec_directory import EcDirectory, image_keys
from .metrics import RouterMetrics
from .registry import WorkerHandle, WorkerRegistry
from .request_state import RequestState

log = logging.getLogger(__name__)

ENCODE_ROLES = ("encode",)
_FAULTS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


class EcStage:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.directory = EcDirectory(config.ec_directory_images)
        self._clock = clock

    # -- before the first leg -------------------------------------------------------------------
    async def prepare(self, state: RequestState) -> None:
        """Fill state.ec_params for a multimodal request: the encoder's answer (if any encoder
        is up and answers), then what other live workers hold for the same images."""
        keys = state.image_keys = image_keys(state.prep.images)
        params: list = []
        skip: set[str] = set()
        handle = self._pick_encoder(keys)
        if handle is not None:
            skip.add(handle.address)  # what it returns now is newer than anything on record
            got = await self._encode(state, handle)
            if got is not None and got.items:
                params.append(got)
                self.directory.record_encoded(keys, handle.address)
                self.directory.record_held(keys, got, handle.address, _epoch(handle))
                self.metrics.ec_attached.labels("encoder").inc()
        shared = self.directory.shared(keys, self._clock(), self._live, exclude=skip)
        if shared:
            self.metrics.ec_attached.labels("shared").inc(len(shared))
        state.ec_params = (params + shared)[:MAX_EC_PRODUCERS]

    def _pick_encoder(self, keys: list[str]) -> WorkerHandle | None:
        handles = self.registry.candidates(ENCODE_ROLES)
        address = self.directory.pick_encoder(keys, [(h.address, h.load().queue_len) for h in handles])
        return None if address is None else self.registry.get(address)

    async def _encode(self, state: RequestState, handle: WorkerHandle) -> object | None:
        timeout = self.config.encode_timeout_s
        remaining = state.prep.remaining()
        if remaining is not None:
            timeout = min(timeout, remaining)
        if timeout <= 0 or state.aborted:
            return None
        started = time.monotonic()
        handle.num_inflight += 1
        try:
            resp = await handle.client.encode(state.request_id, state.prep.images, timeout)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code in _FAULTS:
                self.registry.report_failure(handle, fatal=code == grpc.StatusCode.UNAVAILABLE,
                                             reason=f"Encode {code.name}: {e.details()}")
            self.metrics.ec_encodes.labels(code.name.lower()).inc()
            log.info("request %s: Encode on %s failed (%s: %s); going on without encoder outputs",
                     state.request_id, handle.address, code.name, e.details())
            return None
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the request goes on without E
            self.metrics.ec_encodes.labels("error").inc()
            log.warning("request %s: Encode on %s failed (%r); going on without encoder outputs",
                        state.request_id, handle.address, e)
            return None
        finally:
            handle.num_inflight -= 1
            self.metrics.encode_leg.observe(time.monotonic() - started)
        self.registry.report_success(handle)
        if not _valid(resp.ec_transfer_params):
            # A consumer would refuse the whole request over malformed params: drop them here.
            self.metrics.ec_encodes.labels("invalid").inc()
            log.warning("request %s: encoder %s returned malformed EC params; ignored", state.request_id,
                        handle.address)
            return None
        self.metrics.ec_encodes.labels("ok").inc()
        return resp.ec_transfer_params

    # -- on every leg ---------------------------------------------------------------------------
    @staticmethod
    def attach(state: RequestState, wreq: worker_pb2.WorkerGenerateRequest) -> None:
        if state.ec_params:
            wreq.ec_transfer_params.extend(state.ec_params)

    def record_leg(self, state: RequestState, leg: str, resp: worker_pb2.WorkerGenerateResponse) -> None:
        """A finished leg's worker holds encoder outputs of this request's images for others."""
        if not resp.HasField("ec_transfer_params") or not state.image_keys:
            return
        address = state.leg_address.get(leg)
        handle = self.registry.get(address) if address else None
        if handle is not None and _valid(resp.ec_transfer_params):
            self.directory.record_held(state.image_keys, resp.ec_transfer_params, address, _epoch(handle))
        resp.ClearField("ec_transfer_params")  # the worker's business, not the client's

    def _live(self, address: str, epoch: int) -> bool:
        handle = self.registry.get(address)
        return handle is not None and handle.healthy and _epoch(handle) == epoch


def _valid(params: object) -> bool:
    """Whether params would pass a consumer's check (proto_convert: every field, bounded)."""
    try:
        ec_params_from_proto(params)  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


def _epoch(handle: WorkerHandle) -> int:
    return handle.info.engine_epoch if handle.info is not None else 0
