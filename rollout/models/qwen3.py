"""Qwen3 (Qwen3ForCausalLM): per-head RMSNorm on q and k before rotary, explicit head_dim, no qkv bias."""

from __future__ import annotations

from typing import Any

from rollout.distributed.group import TPGroup
from rollout.models.decoder import DecoderForCausalLM, DecoderSpec, layer_type_windows


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, tp: TPGroup | None = None) -> None:
        bias = bool(getattr(hf_config, "attention_bias", False))
        spec = DecoderSpec(
            qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_windows=layer_type_windows(hf_config)
        )
        super().__init__(hf_config, spec, tp)
