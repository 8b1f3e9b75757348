"""EngineEC: what LLMEngine does with its EC connector (engine/ec_connector.py), in one place.

    build        one connector instance (a factory is called once) handed to the runner's embedder
    producer     remembers the mm_hashes of each request it admitted; on the request's final output
                 asks request_finished() for the params of what it now holds (RequestOutput.ec_transfer_params)
    encode       AsyncEngine.encode(): preprocess -> reserve (PENDING) -> tower (engine-local cache
                 first) -> save -> request_finished -> ECTransferParams
    stats        engine stats["ec_connector"]: mm_items_{computed,local_cache,remote}, transfer_bytes,
                 errors_<reason> (the worker's metrics read these names) + the connector's own counters

All methods run on the engine thread except prepare_encode (pure preprocessing, any thread).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdcluster.config import EngineConfig
from pdcluster.engine.ec_connector import ECConnectorBase, ECConnectorRole, ECItemState
from pdcluster.engine.ec_transfer_params import ECTransferParams
from pdcluster.engine.mm_inputs import MultiModalFeature, load_image, mm_hash
from pdcluster.engine.outputs import RequestOutput
from pdcluster.engine.request import Request

ECConnectorFactory = Callable[[ECConnectorRole, EngineConfig], ECConnectorBase]
ECConnectorArg = ECConnectorBase | ECConnectorFactory | None
_HELD = (ECItemState.READY, ECItemState.PINNED)


def build_ec_connector(config: EngineConfig, arg: ECConnectorArg) -> ECConnectorBase | None:
    if arg is None:
        if config.ec_connector:
            raise ValueError(
                f"ec_connector={config.ec_connector!r} is configured but no EC connector was given to the "
                "engine; pass ec_connector=pdcluster.connectors.ec_connector_factory (the engine never "
                "imports connectors/ itself)")
        return None
    if isinstance(arg, ECConnectorBase):
        return arg
    if callable(arg):
        conn = arg(ECConnectorRole.WORKER, config)
        if not isinstance(conn, ECConnectorBase):
            raise TypeError(f"the EC connector factory returned {type(conn).__name__}, not an ECConnectorBase")
        return conn
    raise TypeError(f"ec_connector must be an ECConnectorBase or a factory, got {type(arg).__name__}")


class EngineEC:
    def __init__(self, connector: ECConnectorBase, embedder: Any) -> None:
        if embedder is None:
            connector.shutdown()
            raise ValueError("an EC connector needs a multimodal model (a vision encoder)")
        self.connector = connector
        self.embedder = embedder
        embedder.ec = connector
        embedder.ec_saves = connector.is_producer
        self._hashes: dict[str, list[str]] = {}  # producer: request -> its distinct mm_hashes

    # -- requests ---------------------------------------------------------------------------------
    def on_added(self, request: Request) -> None:
        if self.connector.is_producer and request.mm_features:
            self._hashes[request.request_id] = list(dict.fromkeys(f.mm_hash for f in request.mm_features))

    def on_aborted(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._hashes.pop(request_id, None)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                hashes = self._hashes.pop(out.request_id, None)
                if hashes and out.error is None:
                    out.ec_transfer_params = self.connector.request_finished(out.request_id, hashes)

    # -- encode -----------------------------------------------------------------------------------
    @staticmethod
    def prepare_encode(mm_processor: Any, images: Sequence[Any]) -> list[MultiModalFeature]:
        """Distinct images (by mm_hash) as features; ValueError naming a bad image or limit."""
        items = mm_processor.images_of({"image": list(images)})
        if not items:
            raise ValueError("encode: no images")
        feats: dict[str, MultiModalFeature] = {}
        for i, item in enumerate(items):
            px = mm_processor.image_processor.preprocess(load_image(item, mm_processor.limits, i))
            h = mm_hash(px, mm_processor.fingerprint)
            n = mm_processor.vision.num_image_tokens(px.shape[1], px.shape[2])
            feats.setdefault(h, MultiModalFeature(h, 0, n, px))
        return list(feats.values())

    def encode(self, request_id: str, features: list[MultiModalFeature]) -> ECTransferParams:
        conn = self.connector
        if not conn.is_producer:
            raise ValueError("encode: this engine's EC connector does not produce (ec role)")
        hashes = [f.mm_hash for f in features]
        conn.reserve([h for h in hashes if conn.item_state(h) not in _HELD])
        outputs = self.embedder.encode_features(features)
        for h in hashes:  # a local-cache hit the producer no longer holds: hold it again
            if conn.item_state(h) not in _HELD:
                conn.save(h, outputs[h])
        params = conn.request_finished(request_id, hashes)
        if params is None or len(params.items) != len(hashes):
            raise RuntimeError(f"encode: the EC producer could not hold all {len(hashes)} item(s) "
                               "(ec_connector_options max_bytes / max_items too small?)")
        return params

    # -- introspection ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        mm = self.embedder
        s = mm.encoder_cache.stats
        out: dict[str, Any] = dict(self.connector.get_stats())
        out.update({"mm_items_computed": s.num_encoded, "mm_items_local_cache": s.hits,
                    "mm_items_remote": mm.num_remote})
        out.setdefault("transfer_bytes", 0)
        for reason, n in mm.errors.items():
            out[f"errors_{reason}"] = out.get(f"errors_{reason}", 0) + n
        return out

    def shutdown(self) -> None:
        self.embedder.ec = None
        self.embedder.ec_saves = False
        self.connector.shutdown()
