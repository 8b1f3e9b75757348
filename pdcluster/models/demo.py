"""The built-in demo model: a small Llama-architecture checkpoint in HF format, trained on Python's docs.

The checkpoint ships inside the package (demo-checkpoint/: bf16 safetensors, its own byte-level BPE
tokenizer and a chat template), made by scripts/train_demo_model.py from text that ships with Python
(pydoc topics and the standard library's docstrings), so `make run` and `pdcluster generate` print
readable text. `ensure_demo_model()` copies it once (atomically: many worker processes may ask at the
same time) under $PDCLUSTER_HOME (default ~/.cache/pdcluster) and returns its path. Commands that
take --model use it when none is given. Copying needs no torch, so the router process may call it.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

DEMO_VERSION = 2  # v1 was random weights: a new directory so an old cached copy is not reused
# Not an identifier, so setuptools does not take the data folder for a package that is not listed.
CHECKPOINT_DIR = pathlib.Path(__file__).resolve().parent / "demo-checkpoint"
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json")
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


def demo_model_dir() -> pathlib.Path:
    home = os.environ.get("PDCLUSTER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "pdcluster")
    return pathlib.Path(home) / f"demo-model-v{DEMO_VERSION}"


def ensure_demo_model(path: str | os.PathLike | None = None) -> str:
    """Return the demo model's directory, copying the shipped checkpoint there first if needed."""
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
    """Copy the shipped trained checkpoint into `out`."""
    out = pathlib.Path(out)
    missing = [n for n in CHECKPOINT_FILES if not (CHECKPOINT_DIR / n).is_file()]
    if missing:
        raise FileNotFoundError(f"the demo checkpoint is incomplete ({CHECKPOINT_DIR} lacks {missing}); "
                                "rebuild it with scripts/train_demo_model.py")
    out.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        shutil.copyfile(CHECKPOINT_DIR / name, out / name)


def hf_config(vocab_size: int) -> dict:
    """config.json of the demo model. Weights are stored in bf16 (half the size); float32 is the
    dtype the engine computes in by default, as it did for the random v1 model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **DEMO_CONFIG,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
    }


def write_config_files(out: pathlib.Path, config: dict) -> None:
    """config.json, generation_config.json and tokenizer_config.json (the tokenizer.json is the trainer's)."""
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>",
        "add_bos_token": True, "model_max_length": DEMO_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
