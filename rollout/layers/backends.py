"""Pick the attention backend: flash-attn when it imports (and the block size suits it), else Triton on
CUDA, torch on the CPU."""

from __future__ import annotations

import importlib.util

import torch

from rollout.layers.attention import TorchAttentionBackend


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def make_attention_backend(name: str, device: torch.device, block_size: int = 16) -> object:
    if name == "auto":
        if device.type != "cuda":
            name = "torch"
        elif flash_attn_available() and block_size % 256 == 0:
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
