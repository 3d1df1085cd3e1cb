"""Supported architectures, keyed by the name Hugging Face writes in ``config.architectures``."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from rollout.models.decoder import DecoderForCausalLM
from rollout.models.llama import LlamaForCausalLM
from rollout.models.mistral import MistralForCausalLM
from rollout.models.qwen2 import Qwen2ForCausalLM
from rollout.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES: Mapping[str, type[DecoderForCausalLM]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "MistralForCausalLM": MistralForCausalLM,
    }
)
# A config built in memory (``LlamaConfig(...)``, ``from_config``) has no ``architectures`` until saved.
_BY_MODEL_TYPE: Mapping[str, type[DecoderForCausalLM]] = MappingProxyType(
    {
        "llama": LlamaForCausalLM,
        "qwen2": Qwen2ForCausalLM,
        "qwen3": Qwen3ForCausalLM,
        "mistral": MistralForCausalLM,
    }
)


def get_model_class(hf_config: Any) -> type[DecoderForCausalLM]:
    """The class for ``hf_config.architectures`` (or, when absent, its ``model_type``)."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = getattr(hf_config, "model_type", None)
    if not names and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    got = names or f"model_type={model_type!r}"
    raise ValueError(f"unsupported architecture {got}; supported: {sorted(ARCHITECTURES)}")


__all__ = [
    "ARCHITECTURES",
    "DecoderForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
]
