"""EcDirectory: what the router knows about encoder outputs in the cluster, keyed by image bytes.

Pure bookkeeping (no I/O; the clock is passed in), so every rule is unit-tested in microseconds:

    affinity    image key -> the encode worker that last encoded it. An image goes back to the
                encoder whose encoder cache holds it (a cache hit, not a second tower run); an
                image nobody encoded goes to the least loaded encoder.
    held        image key -> {producer address: the EcTransferParams it returned}. Filled from the
                final response of a leg that encoded images and holds them for others (a prefill
                worker when there is no encoder, or an aggregated one); attached to the next legs
                that get the same image, so instances share encodings among themselves.

An image key is sha256 of the image's encoded bytes: the router never decodes images, so two
encodings of the same pixels are two keys (the engines still share them by mm_hash inside one
instance). The engine-side mm_hash is not derivable here; a params value is therefore recorded
under every image of the request it came from, and the consumer fetches only the items whose
mm_hash it needs (the rest are ignored), so over-attaching costs bytes of metadata, never a
wrong embedding.

Bounds: at most `max_images` keys in each map (LRU), at most MAX_PRODUCERS_PER_IMAGE producers per
key, at most MAX_EC_PRODUCERS params per request. A held entry is dropped when its lease has
expired (or ends within `lease_margin_s`: a consumer needs time to fetch), when its producer is
no longer a healthy worker of the same incarnation (`live(address, epoch)` says so), or when
`forget(address)` is called (a worker removed).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pdcluster.engine.ec_transfer_params import MAX_EC_PRODUCERS

MAX_PRODUCERS_PER_IMAGE = 4
DEFAULT_MAX_IMAGES = 4096
DEFAULT_LEASE_MARGIN_S = 1.0

Live = Callable[[str, int], bool]  # (producer address, its WorkerInfo epoch when recorded) -> still there


def image_keys(images: Iterable[bytes]) -> list[str]:
    """The request's image keys, in prompt order (duplicates kept)."""
    return [hashlib.sha256(image).hexdigest() for image in images]


@dataclass(frozen=True)
class Held:
    params: Any  # the proto EcTransferParams, as the producer returned it
    address: str  # the producer worker's gRPC address (the registry's key)
    epoch: int  # its WorkerInfo.engine_epoch when recorded: a restart loses every item
    expires_at: float  # Unix time the leases end (0: the producer named none)

    def usable(self, now: float, margin_s: float) -> bool:
        return self.expires_at == 0 or self.expires_at - margin_s > now


class EcDirectory:
    def __init__(self, max_images: int = DEFAULT_MAX_IMAGES, lease_margin_s: float = DEFAULT_LEASE_MARGIN_S) -> None:
        if max_images < 1:
            raise ValueError(f"max_images must be at least 1, got {max_images}")
        self.max_images = max_images
        self.lease_margin_s = lease_margin_s
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._held: OrderedDict[str, OrderedDict[str, Held]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    # -- encoders -------------------------------------------------------------------------------
    def pick_encoder(self, keys: Sequence[str], encoders: Sequence[tuple[str, int]]) -> str | None:
        """The encoder for a request's images: the one that encoded most of them, ties and
        strangers by least load (queue length), then address. encoders: (address, load)."""
        if not encoders:
            return None
        hits: dict[str, int] = {}
        for key in dict.fromkeys(keys):
            address = self._affinity.get(key)
            if address is not None:
                hits[address] = hits.get(address, 0) + 1
        return min(encoders, key=lambda e: (-hits.get(e[0], 0), e[1], e[0]))[0]

    def record_encoded(self, keys: Sequence[str], address: str) -> None:
        for key in dict.fromkeys(keys):
            self._affinity[key] = address
            self._affinity.move_to_end(key)
        while len(self._affinity) > self.max_images:
            self._affinity.popitem(last=False)

    # -- shared encodings -----------------------------------------------------------------------
    def record_held(self, keys: Sequence[str], params: Any, address: str, epoch: int) -> None:
        """A producer holds encoder outputs for these images (params: proto EcTransferParams)."""
        if not params.items:
            return
        held = Held(params, address, epoch, float(params.expires_at))
        for key in dict.fromkeys(keys):
            producers = self._held.get(key)
            if producers is None:
                producers = self._held[key] = OrderedDict()
            producers[address] = held  # a newer lease from the same producer replaces the old one
            producers.move_to_end(address)
            while len(producers) > MAX_PRODUCERS_PER_IMAGE:
                producers.popitem(last=False)
            self._held.move_to_end(key)
        while len(self._held) > self.max_images:
            self._held.popitem(last=False)

    def shared(self, keys: Sequence[str], now: float, live: Live, exclude: Iterable[str] = ()) -> list[Any]:
        """Params of live producers holding any of these images (newest first, distinct, at
        most MAX_EC_PRODUCERS), skipping producers in exclude; stale entries are dropped."""
        skip = set(exclude)
        out: dict[str, Any] = {}  # address -> params (one value per producer: the newest)
        for key in dict.fromkeys(keys):
            producers = self._held.get(key)
            if producers is None:
                continue
            for address, held in reversed(list(producers.items())):
                if not held.usable(now, self.lease_margin_s) or not live(address, held.epoch):
                    del producers[address]
                    continue
                if address not in skip and address not in out:
                    out[address] = held
            if not producers:
                del self._held[key]
            else:
                self._held.move_to_end(key)
        newest = sorted(out.values(), key=lambda h: -h.expires_at)
        return [h.params for h in newest[:MAX_EC_PRODUCERS]]

    def forget(self, address: str) -> None:
        """A worker went away: nothing it held or encoded is reachable there any more."""
        for key in [k for k, a in self._affinity.items() if a == address]:
            del self._affinity[key]
        for key in list(self._held):
            producers = self._held[key]
            producers.pop(address, None)
            if not producers:
                del self._held[key]
