"""The model runner's multimodal step: encoder outputs for the images scheduled this step,
scattered into the input embeddings of their placeholder positions.

For request r with tokens [c, c + n) scheduled and an image with placeholders [o, o + L):

    overlap [lo, hi) = [max(c, o), min(c + n, o + L))
    embeds[batch index of token lo .. hi) = encoder_output(image)[lo - o : hi - o]

so a chunk that ends (or a prefix-cache hit that stops) in the middle of an image consumes the
encoder output in slices. An image is encoded when its placeholders are first scheduled (all
misses of one step in one batched tower call per pixel shape), looked up in the engine-local
EncoderCache by mm_hash, and held by the request until it finishes.

With an EC connector (engine/ec_connector.py, set as `self.ec` by LLMEngine): an output the
connector fetched for the request (MultiModalFeature.remote_output) is used instead of the tower
when its shape and dtype are what this encoder yields (else counted errors_malformed and encoded
here); a producer connector gets every output the tower computed or it fetched (`save`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from pdcluster.engine.encoder_cache import EncoderCache
from pdcluster.engine.mm_inputs import MultiModalFeature
from pdcluster.engine.outputs import SchedulerOutput


class MultiModalEmbedder:
    def __init__(self, model: Any, device: torch.device, cache_bytes: int) -> None:
        self.model = model
        self.device = device
        self.encoder_cache = EncoderCache(cache_bytes)
        self._features: dict[str, list[MultiModalFeature]] = {}
        self._held: dict[str, dict[str, torch.Tensor]] = {}  # request -> mm_hash -> output
        self.ec: Any = None  # ec_connector.ECConnectorBase (worker side), when the engine has one
        self.ec_saves = False  # the connector keeps what the tower computes (a producer)
        self.num_remote = 0  # items taken from an EC fetch instead of the tower
        self.errors: Counter[str] = Counter()  # fetched items refused here, by reason

    def update(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self._features.pop(request_id, None)
            self._held.pop(request_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            feats = list(getattr(new, "mm_features", None) or ())
            if feats:
                self._features[new.request_id] = feats
                self._held.setdefault(new.request_id, {})

    def inputs_embeds(self, request_ids: list[str], context_lens: list[int], query_lens: list[int],
                      input_ids: torch.Tensor) -> torch.Tensor | None:
        """Input embeddings with image features scattered in, or None when no scheduled token is a
        placeholder (the model then embeds input_ids itself)."""
        slices: list[tuple[str, int, MultiModalFeature, int, int]] = []
        base = 0
        for request_id, c, n in zip(request_ids, context_lens, query_lens):
            for f in self._features.get(request_id, ()):
                lo, hi = max(c, f.offset), min(c + n, f.end)
                if lo < hi:
                    slices.append((request_id, base + lo - c, f, lo - f.offset, hi - f.offset))
            base += n
        if not slices:
            return None
        outputs = self._encode([(request_id, f) for request_id, _, f, _, _ in slices])
        embeds = self.model.embed_input_ids(input_ids)
        for _, pos, f, lo, hi in slices:
            embeds[pos:pos + hi - lo] = outputs[f.mm_hash][lo:hi].to(embeds.dtype)
        return embeds

    def _encode(self, wanted: list[tuple[str, MultiModalFeature]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        misses: dict[str, MultiModalFeature] = {}
        for request_id, f in wanted:
            held = self._held.setdefault(request_id, {})
            if f.mm_hash in held:
                out[f.mm_hash] = held[f.mm_hash]
                continue
            if f.mm_hash not in out and f.mm_hash not in misses:
                remote = self._take_remote(request_id, f)
                cached = remote if remote is not None else self.encoder_cache.get(f.mm_hash)
                if cached is not None:
                    out[f.mm_hash] = cached
                else:
                    misses[f.mm_hash] = f
        by_shape: dict[tuple[int, ...], list[MultiModalFeature]] = {}
        for f in misses.values():
            by_shape.setdefault(tuple(f.pixel_values.shape), []).append(f)
        for feats in by_shape.values():
            # float32 pixels; the tower casts them to its weights' dtype (as transformers does)
            pixels = torch.stack([torch.from_numpy(f.pixel_values) for f in feats]).to(self.device)
            encoded = self.model.encode_images(pixels)  # (N, P, H)
            self.encoder_cache.stats.num_encoded += len(feats)
            for f, emb in zip(feats, encoded):
                if emb.shape[0] != f.length:
                    raise RuntimeError(f"image {f.mm_hash[:12]}: the encoder gave {emb.shape[0]} embeddings "
                                       f"for {f.length} placeholders")
                emb = emb.contiguous()
                out[f.mm_hash] = emb
                self.encoder_cache.put(f.mm_hash, emb, emb.numel() * emb.element_size())
                if self.ec_saves:
                    self.ec.save(f.mm_hash, emb)
        for request_id, f in wanted:
            self._held[request_id][f.mm_hash] = out[f.mm_hash]
        return out

    def encode_features(self, features: list[MultiModalFeature]) -> dict[str, torch.Tensor]:
        """Outputs of `features` outside any request (AsyncEngine.encode): cache first, tower for the
        rest (saved to a producer connector like any other)."""
        key = "\x00encode"  # not a valid request id (input_processor): never collides with one
        try:
            with torch.inference_mode():
                return self._encode([(key, f) for f in features])
        finally:
            self._held.pop(key, None)

    def _take_remote(self, request_id: str, f: MultiModalFeature) -> torch.Tensor | None:
        """The EC-fetched output of f, if usable (and then also cached here)."""
        emb, f.remote_output = f.remote_output, None  # consumed once; the request holds it from here on
        if emb is None:
            return None
        hidden = self.model.vision_config.text_hidden_size
        dtype = next(self.model.multi_modal_projector.parameters()).dtype
        if not isinstance(emb, torch.Tensor) or tuple(emb.shape) != (f.length, hidden) or emb.dtype != dtype:
            self.errors["malformed"] += 1
            return None
        emb = emb.to(self.device)
        self.num_remote += 1
        self.encoder_cache.put(f.mm_hash, emb, emb.numel() * emb.element_size())
        if self.ec is not None:
            self.ec.update_state_after_alloc(request_id, f.mm_hash)
        if self.ec_saves:  # a producer holds what it fetched too, so it can serve the next instance
            self.ec.save(f.mm_hash, emb)
        return emb
