"""EncoderRunner: the executor of an encoder-only engine (EngineArgs.encoder_only, an encode instance).

It loads only the LLaVA vision tower + projector (models/llava.py LlavaEncoder; no decoder weights,
no KV cache) and owns the MultiModalEmbedder that AsyncEngine.encode() runs images through. Such an
engine takes no generate() requests (LLMEngine refuses them), so every step it is handed is empty.
"""

from __future__ import annotations

from typing import Any

import torch

from pdcluster.config import EngineConfig
from pdcluster.engine.mm_embedder import MultiModalEmbedder
from pdcluster.engine.outputs import ModelRunnerOutput, SchedulerOutput


class EncoderRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, connector: Any = None) -> None:
        from pdcluster.models.llava import load_llava_encoder

        if connector is not None:
            raise ValueError("an encoder_only engine takes no KV connector (it has no KV cache)")
        self.config = config
        self.device = torch.device(config.device)
        self.model = load_llava_encoder(config.model, self.device)
        self.mm = MultiModalEmbedder(self.model, self.device, config.mm.encoder_cache_bytes)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.total_num_scheduled_tokens:
            raise RuntimeError("an encoder_only engine runs no decoder steps")
        self.mm.update(scheduler_output)
        return ModelRunnerOutput([], [])

    def shutdown(self) -> None:
        self.mm.encoder_cache.clear()
