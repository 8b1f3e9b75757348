"""vLLM's --generation-config: the sampling defaults a checkpoint's generation_config.json sets.

Instruct checkpoints ship their authors' sampling settings (Llama-3 instruct: temperature 0.6,
top_p 0.9). vLLM applies them to every request that leaves the field out, unless started with
`--generation-config vllm`; so do we, at the one place requests are completed (the router's
Preprocessor; the offline LLM's default SamplingParams). A request's own value always wins.

    auto     the model directory's generation_config.json (the default; none there: no defaults)
    vllm     none: SamplingParams' own defaults
    FOLDER   that folder's generation_config.json (it must exist)

Read: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens (the default
max_tokens where the request means "as long as it takes", i.e. chat). Pure Python, no torch.
"""

from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass

from pdcluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class GenerationDefaults:
    """SamplingParams field -> default, as (name, value) pairs; () = none."""

    values: tuple[tuple[str, float | int], ...] = ()

    @property
    def sampling(self) -> dict[str, float | int]:
        """The defaults of the sampling fields (all but max_tokens)."""
        return {k: v for k, v in self.values if k != "max_tokens"}

    @property
    def max_tokens(self) -> int | None:
        return next((int(v) for k, v in self.values if k == "max_tokens"), None)


def load_generation_defaults(spec: str, model_path: str | None) -> GenerationDefaults:
    """ValueError naming --generation-config for a folder without the file or bad values in it."""
    if spec == "vllm":
        return GenerationDefaults()
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--generation-config must be 'auto', 'vllm' or a folder, got {spec!r}")
    folder = model_path if spec == "auto" else spec
    path = pathlib.Path(folder or "") / "generation_config.json"
    if not path.is_file():
        if spec == "auto":
            return GenerationDefaults()
        raise ValueError(f"--generation-config: {path} does not exist")
    try:
        if path.stat().st_size > _MAX_FILE_BYTES:
            raise ValueError("larger than 1 MiB")
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: cannot read {path}: {e}") from None
    values = {field: raw[key] for key, field in _KEYS.items() if raw.get(key) is not None}
    if "top_k" in values and values["top_k"] == 0:
        values.pop("top_k")  # transformers' "no top-k"
    try:
        SamplingParams(**{k: v for k, v in values.items() if k != "max_tokens"})
        if "max_tokens" in values:
            SamplingParams(max_tokens=values["max_tokens"])
    except ValueError as e:
        raise ValueError(f"--generation-config: {path}: {e}") from None
    if values:
        logger.info("sampling defaults from %s (a request's own values win): %s", path, values)
    return GenerationDefaults(tuple(sorted(values.items())))
