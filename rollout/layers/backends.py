"""Pick the attention backend: flash-attn when it imports (and the block size and KV dtype suit it), else
Triton on CUDA, torch on the CPU."""

from __future__ import annotations

import importlib.util

import torch

from rollout.layers.attention import TorchAttentionBackend


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def make_attention_backend(
    name: str, device: torch.device, block_size: int = 16, kv_cache_dtype: str = "auto"
) -> object:
    """``kv_cache_dtype`` other than "auto" (the model's dtype) keeps "auto" off flash-attn, which reads
    only a cache in the query's dtype; the Triton and torch backends read every supported type."""
    if name == "flash_attn" and kv_cache_dtype == "fp8":
        raise ValueError("kv_cache_dtype='fp8' needs attention_backend 'triton', 'torch' or 'auto', not 'flash_attn'")
    if name == "auto":
        if device.type != "cuda":
            name = "torch"
        elif flash_attn_available() and block_size % 256 == 0 and kv_cache_dtype == "auto":
            name = "flash_attn"
        else:
            name = "triton"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "flash_attn" and not flash_attn_available():
        raise ValueError("attention_backend='flash_attn' but the flash-attn package is not installed")
    if name in ("triton", "flash_attn") and device.type != "cuda":
        raise ValueError(f"attention_backend={name!r} needs a CUDA device, got {device.type!r}; "
                         "use 'torch' or 'auto' on the CPU")
    if name == "triton":
        from rollout.layers.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash_attn":
        if not flash_attn_available():
            raise ValueError("attention_backend='flash_attn' but the flash-attn package is not installed")
        from rollout.layers.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend(block_size)
    raise ValueError(f"unknown attention_backend {name!r}")
