"""Pick the attention backend: flash-attn when it imports (and the block size and KV dtype suit it), else
Triton on CUDA, torch on the CPU. The engine decides once (``resolve_attention``) and hands the
resulting ``AttentionSpec`` to every tensor-parallel rank, so all ranks build the same backend."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from rollout.layers.attention import TorchAttentionBackend


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """A decided attention backend: what every rank builds, identically."""

    backend: str  # "torch", "triton" or "flash_attn" (never "auto")
    block_size: int
    kv_cache_dtype: str  # "auto" (the model's dtype) or "fp8"

    def build(self) -> object:
        if self.backend == "torch":
            return TorchAttentionBackend()
        if self.backend == "triton":
            from rollout.layers.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend()
        from rollout.layers.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend(self.block_size)


def resolve_attention(
    name: str, device: torch.device, block_size: int = 16, kv_cache_dtype: str = "auto"
) -> AttentionSpec:
    """Check the choice and decide "auto". ``kv_cache_dtype`` other than "auto" (the model's dtype) keeps
    "auto" off flash-attn, which reads only a cache in the query's dtype; the Triton and torch backends
    read every supported type."""
    if name == "flash_attn" and kv_cache_dtype == "fp8":
        raise ValueError("kv_cache_dtype='fp8' needs attention_backend 'triton', 'torch' or 'auto', not 'flash_attn'")
    if name == "auto":
        if device.type != "cuda":
            name = "torch"
        elif flash_attn_available() and block_size % 256 == 0 and kv_cache_dtype == "auto":
            name = "flash_attn"
        else:
            name = "triton"
    if name not in ("torch", "triton", "flash_attn"):
        raise ValueError(f"unknown attention_backend {name!r}; allowed: 'auto', 'torch', 'triton', 'flash_attn'")
    if name == "flash_attn" and not flash_attn_available():
        raise ValueError("attention_backend='flash_attn' but the flash-attn package is not installed")
    if name != "torch" and device.type != "cuda":
        raise ValueError(f"attention_backend={name!r} needs a CUDA device, got {device.type!r}; "
                         "use 'torch' or 'auto' on the CPU")
    return AttentionSpec(name, block_size, kv_cache_dtype)
