"""Worker.Encode: run the vision encoder on a request's images and hand back where the outputs are.

    EncodeRequest{request_id, images (PNG/JPEG bytes, prompt order)}
        -> AsyncEngine.encode(request_id, images)   preprocess, engine-local encoder cache first,
                                                    the tower for the misses, outputs saved into the
                                                    engine's EC producer under a lease
        -> EncodeResponse{ec_transfer_params}       one item per distinct image

Served by any worker whose engine has a vision tower and an EC connector (the encode role is the
one built for it); elsewhere UNIMPLEMENTED, so a router can tell "not here" from "bad images".
Status codes: bad image bytes or limits INVALID_ARGUMENT naming `images[i]`; draining, a dead
engine UNAVAILABLE; the call's deadline DEADLINE_EXCEEDED. Nothing an Encode does can fail another
request: the engine counts EC errors by reason and keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import grpc

from pdcluster._proto import worker_pb2
from pdcluster.engine.ec_transfer_params import MAX_EC_ITEMS
from pdcluster.proto_convert import ec_params_to_proto

if TYPE_CHECKING:
    from pdcluster.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


class EncodeRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


async def encode(engine: AsyncEngine, request: worker_pb2.EncodeRequest, *, request_id: str,
                 timeout_s: float | None, draining: bool) -> worker_pb2.EncodeResponse:
    """One Encode call; raises EncodeRefused with the status to end the RPC with."""
    run = getattr(engine, "encode", None)
    if run is None:
        raise EncodeRefused(grpc.StatusCode.UNIMPLEMENTED, "this worker's engine cannot encode images")
    endpoint = getattr(engine, "ec_endpoint", None)
    if endpoint is not None and endpoint() is None:
        raise EncodeRefused(grpc.StatusCode.UNIMPLEMENTED, "this worker holds no encoder outputs for others "
                            "(no EC connector, or one that only consumes)")
    if not request.images:
        raise EncodeRefused(grpc.StatusCode.INVALID_ARGUMENT, "images: at least one image is required")
    if len(request.images) > MAX_EC_ITEMS:
        raise EncodeRefused(grpc.StatusCode.INVALID_ARGUMENT,
                            f"images: at most {MAX_EC_ITEMS} per Encode, got {len(request.images)}")
    if draining:
        raise EncodeRefused(grpc.StatusCode.UNAVAILABLE, "worker is draining; send the images to another encoder")
    if not engine.is_healthy:
        raise EncodeRefused(grpc.StatusCode.UNAVAILABLE, "engine is not running")
    try:
        params = await asyncio.wait_for(run(request_id, list(request.images)), timeout_s)
    except asyncio.TimeoutError:
        raise EncodeRefused(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while encoding") from None
    except NotImplementedError as e:  # no vision tower or no EC producer on this engine
        raise EncodeRefused(grpc.StatusCode.UNIMPLEMENTED, str(e) or "this worker cannot encode images") from None
    except ValueError as e:  # bad bytes or a limit: name the wire field, as Generate does
        text = str(e).replace("multi_modal_data['image']", "images").replace("multi_modal_data", "images")
        raise EncodeRefused(grpc.StatusCode.INVALID_ARGUMENT, text) from None
    except Exception as e:  # noqa: BLE001 - mapped to a status, the worker keeps serving
        raise EncodeRefused(_code_of(e), f"encode failed: {e!r}") from None
    return worker_pb2.EncodeResponse(ec_transfer_params=ec_params_to_proto(params))


def _code_of(e: Any) -> grpc.StatusCode:
    from pdcluster.engine.async_engine import EngineDeadError

    if isinstance(e, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE
    log.error("encode failed", exc_info=e)
    return grpc.StatusCode.INTERNAL
