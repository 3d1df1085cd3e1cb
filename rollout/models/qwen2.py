"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): q/k/v biases (o_proj has none), often tied embeddings."""

from __future__ import annotations

from typing import Any

from rollout.distributed.group import TPGroup
from rollout.models.decoder import DecoderForCausalLM, DecoderSpec, layer_type_windows


class Qwen2ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, tp: TPGroup | None = None) -> None:
        spec = DecoderSpec(qkv_bias=True, sliding_windows=layer_type_windows(hf_config))
        super().__init__(hf_config, spec, tp)
