"""Tiny random LLaVA checkpoints for the multimodal tests, built and saved by transformers itself:
a tiny CLIP tower, a tiny Llama decoder, a CLIPImageProcessor config (preprocessor_config.json),
a LlavaProcessor config and a word-level tokenizer whose last id is the `<image>` token."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from tiny_models import TINY_COMMON

VOCAB = 384
IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = VOCAB - 1
IMAGE_SIZE, PATCH = 32, 8  # 16 patches: 16 placeholders per image under "default"


def write_tokenizer(path: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB - 1)}
    vocab[IMAGE_TOKEN] = IMAGE_TOKEN_ID
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}, f)


def make_tiny_llava(path: str | os.PathLike, seed: int = 0, vision_feature_layer: Any = -2,
                    vision_feature_select_strategy: str = "default", text_model_type: str = "llama",
                    vision_hidden_act: str = "quick_gelu", projector_hidden_act: str = "gelu") -> str:
    import transformers as tf

    tf.utils.logging.disable_progress_bar()
    path = str(path)
    text_cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[text_model_type]
    text = text_cls(**{**TINY_COMMON, "vocab_size": VOCAB})
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32, hidden_act=vision_hidden_act)
    cfg = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
                         vision_feature_layer=vision_feature_layer,
                         vision_feature_select_strategy=vision_feature_select_strategy,
                         projector_hidden_act=projector_hidden_act)
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # CLIP's default init is tiny: widen it so images move the logits
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                if p.ndim > 1 or "class_embedding" in name:
                    p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    write_tokenizer(path)
    image_processor = tf.CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                               crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    image_processor.save_pretrained(path)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "LlavaProcessor", "patch_size": PATCH,
                   "vision_feature_select_strategy": vision_feature_select_strategy,
                   "num_additional_image_tokens": 1, "image_token": IMAGE_TOKEN}, f)
    return path


def hf_processor(path: str) -> Any:
    import transformers as tf

    image_processor = tf.CLIPImageProcessorPil.from_pretrained(path)
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"), unk_token="t0")
    cfg = json.load(open(os.path.join(path, "processor_config.json")))
    return tf.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=cfg["patch_size"],
                             vision_feature_select_strategy=cfg["vision_feature_select_strategy"],
                             num_additional_image_tokens=cfg["num_additional_image_tokens"])


def random_image(seed: int, width: int = IMAGE_SIZE, height: int = IMAGE_SIZE, mode: str = "RGB") -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode=mode)


def hf_greedy(path: str, prompt: str, images: list[Any], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on the processor's inputs -> the new token ids."""
    import transformers as tf

    proc = hf_processor(path)
    model = tf.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = proc(text=prompt, images=images or None, return_tensors="pt")
    # No eos: the engine runs with ignore_eos (min_new_tokens would mask eos and change the argmax).
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
