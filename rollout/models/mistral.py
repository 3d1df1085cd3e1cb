"""Mistral (MistralForCausalLM): the Llama body; ``sliding_window``, when set, applies to every layer."""

from __future__ import annotations

from typing import Any

from rollout.distributed.group import TPGroup
from rollout.models.decoder import DecoderForCausalLM, DecoderSpec


class MistralForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, tp: TPGroup | None = None) -> None:
        window = getattr(hf_config, "sliding_window", None)
        windows = None if window is None else (window,) * hf_config.num_hidden_layers
        super().__init__(hf_config, DecoderSpec(sliding_windows=windows), tp)
