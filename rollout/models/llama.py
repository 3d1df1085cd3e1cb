"""Llama 3 (LlamaForCausalLM): the plain decoder; optional attention / MLP biases, llama3 rope scaling."""

from __future__ import annotations

from typing import Any

from rollout.distributed.group import TPGroup
from rollout.models.decoder import DecoderForCausalLM, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, tp: TPGroup | None = None) -> None:
        bias = bool(getattr(hf_config, "attention_bias", False))
        spec = DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))
        super().__init__(hf_config, spec, tp)
