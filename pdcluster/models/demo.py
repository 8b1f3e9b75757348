"""The built-in demo model: a small deterministic Llama-architecture checkpoint in HF format.

`ensure_demo_model()` writes it once (atomically: many worker processes may ask at the same time)
under $PDCLUSTER_HOME (default ~/.cache/pdcluster) and returns its path. It has random weights
(seeded, so identical on every machine) and a real byte-level BPE tokenizer trained on the text
below, with a chat template, so every path a real checkpoint takes (config, safetensors, tokenizer,
chat) is exercised. Commands that take --model use it when none is given.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

DEMO_VERSION = 1
DEMO_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_CORPUS = """
A disaggregated serving cluster splits every request in two. The prefill pool reads the whole
prompt at once and writes the key and value cache; the decode pool then generates one token at a
time. The two pools hand cache blocks to each other through connectors: a peer to peer connector
that reads blocks straight from the producer's memory, and a store that every instance can share.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Tokens, blocks, pages and caches; routers, workers, schedulers and kernels. Hello, world!
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: . , ; : ! ? ( ) [ ] { } " ' - _ / \\ @ # % &.
Unicode: café, naïve, Straße, 東京, 안녕하세요, Привет, مرحبا, 🙂 🚀.
"""


def demo_model_dir() -> pathlib.Path:
    home = os.environ.get("PDCLUSTER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "pdcluster")
    return pathlib.Path(home) / f"demo-model-v{DEMO_VERSION}"


def ensure_demo_model(path: str | os.PathLike | None = None) -> str:
    """Return the demo model's directory, writing it first if needed."""
    target = pathlib.Path(path) if path is not None else demo_model_dir()
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        write_demo_model(tmp)
        try:
            os.rename(tmp, target)  # atomic publish; loses the race gracefully below
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def write_demo_model(out: str | os.PathLike) -> None:
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_tokenizer(out)
    cfg = dict(DEMO_CONFIG)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **cfg,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    _write_weights(out, config)


def _write_tokenizer(out: pathlib.Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, min_frequency=1, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>",
        "add_bos_token": True, "model_max_length": DEMO_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    return tok.get_vocab_size()


def _write_weights(out: pathlib.Path, config: dict) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1234)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = h // nh

    def w(*shape: int) -> torch.Tensor:
        # std 0.02 like HF's initializer_range; scaled up so the demo's logits are not all flat.
        return (torch.randn(*shape, generator=g) * 0.05).contiguous()

    tensors = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h), "lm_head.weight": w(v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(nh * hd, h),
            p + "self_attn.k_proj.weight": w(nkv * hd, h),
            p + "self_attn.v_proj.weight": w(nkv * hd, h),
            p + "self_attn.o_proj.weight": w(h, nh * hd),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
