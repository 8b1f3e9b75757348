"""Encoder outputs fetched over the p2p_ec connector (shared memory, TCP) vs recomputed locally.

    .venv/bin/python benchmarks/ec_transfer.py [--layers 12] [--repeats 3] [--json out.json]

A random LLaVA checkpoint with a CLIP-B/16-sized tower (224 px, patch 16: 196 image tokens, 768
wide, `--layers` deep) and a projector to `--text-hidden` is made with transformers in a temp dir.
An encoder-only engine with a p2p_ec producer encodes 1 and 4 images and holds them; then, per
image count (medians; the fetches after one warm-up):

  local     the tower + projector on the images (engine-local encoder cache off): what a consumer
            without EC pays
  ec_shm    a p2p_ec consumer fetches the outputs: CURVE control round trips, shared-memory copy,
            blake3 digest check, release
  ec_tcp    the same over the TCP data plane with the payload MAC

Bytes are the encoder outputs moved (float32). The numbers are one quiet-ish 2-vCPU VM's: the
tower's cost grows with its size, the fetch's with the bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np


def make_checkpoint(path: str, layers: int, text_hidden: int) -> str:
    import torch
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = 384
    text = tf.LlamaConfig(vocab_size=vocab, hidden_size=text_hidden, intermediate_size=256, num_hidden_layers=1,
                          num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024)
    vision = tf.CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=layers,
                                 num_attention_heads=12, image_size=224, patch_size=16, projection_dim=512)
    cfg = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=vocab - 1,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    tf.LlavaForConditionalGeneration(cfg).eval().save_pretrained(path)
    words = {f"t{i}": i for i in range(vocab - 1)} | {"<image>": vocab - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}, f)
    tf.CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}).save_pretrained(path)
    return path


def png(seed: int) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, size=(224, 224, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--text-hidden", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5, help="fetches per row (median, after one warm-up)")
    ap.add_argument("--local-repeats", type=int, default=1, help="tower runs per row (median)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from pdcluster import AsyncEngine
    from pdcluster.config import EngineArgs
    from pdcluster.connectors import ec_connector_factory
    from pdcluster.connectors.ec.fetcher import ECFetcher
    from pdcluster.connectors.ec.options import ECOptions
    from pdcluster.engine.ec_connector import ECConnectorMetadata, ECItemLoad
    from pdcluster.security.keys import generate_keypair, keypair_to_string

    tmp = tempfile.mkdtemp(prefix="ec-bench-")
    path = make_checkpoint(os.path.join(tmp, "ckpt"), a.layers, a.text_hidden)
    pairs = {n: generate_keypair(n) for n in ("encoder", "consumer")}
    allowed = {n: kp.public.decode() for n, kp in pairs.items()}
    engine = AsyncEngine.from_engine_args(EngineArgs(
        model=path, device="cpu", encoder_only=True, encoder_cache_bytes=0, ec_connector="p2p_ec",
        ec_connector_options={"keypair": keypair_to_string(pairs["encoder"]), "allowed_keys": allowed,
                              "role": "producer"}), ec_connector=ec_connector_factory)
    fetchers = {t: ECFetcher(ECOptions.from_dict({"keypair": keypair_to_string(pairs["consumer"]),
                                                  "allowed_keys": allowed, "role": "consumer", "transport": t}),
                             engine.engine.ec.connector.fingerprint) for t in ("shm", "tcp")}
    rows = []
    try:
        for n in (1, 4):
            images = [png(1000 * n + i) for i in range(n)]
            features = engine.engine.prepare_encode(images)
            mm = engine.engine.core.runner.mm
            local = median_s(lambda mm=mm, feats=features: mm.encode_features(feats), a.local_repeats)  # cache off
            params = asyncio.run(engine.encode(f"bench-{n}", images))
            meta = ECConnectorMetadata("bench", [ECItemLoad(i.mm_hash, i.num_tokens, params, i) for i in params.items])
            nbytes = sum(i.nbytes for i in params.items)
            row: dict[str, Any] = {"images": n, "bytes": nbytes, "local_s": local}
            for t, fetcher in fetchers.items():
                def once(fetcher: ECFetcher = fetcher, meta: ECConnectorMetadata = meta) -> None:
                    report = fetcher.start(meta).result()
                    assert not report.failed, report.failed
                once()  # warm-up: maps the producer's segment, opens the pooled TCP connection
                row[f"ec_{t}_s"] = median_s(once, a.repeats)
            rows.append(row)
            print(f"{n} image(s), {nbytes / 1e6:.2f} MB: local {local * 1e3:.1f} ms, "
                  f"ec shm {row['ec_shm_s'] * 1e3:.2f} ms, ec tcp {row['ec_tcp_s'] * 1e3:.2f} ms", flush=True)
    finally:
        for f in fetchers.values():
            f.close()
        engine.shutdown()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"layers": a.layers, "text_hidden": a.text_hidden, "repeats": a.repeats,
                       "local_repeats": a.local_repeats, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
