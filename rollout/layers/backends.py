"""Pick the attention backend: FA4 prefill + Triton decode ("fa4") or flash-attn when they import (and the block
size and KV dtype suit them), else Triton on CUDA, torch on the CPU. The engine decides once
(``resolve_attention``) and hands the resulting ``AttentionSpec`` to every tensor-parallel rank, so all ranks
build the same backend."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from rollout.layers.attention import TorchAttentionBackend

BACKENDS = ("torch", "triton", "flash_attn", "fa4")
FA4_AUTO_BLOCK_SIZE = 128  # FA4's TMA page (its key tile at head_dim <= 128): the only size "auto" gives it
FA4_KV_DTYPES = ("auto", "bfloat16", "float16")  # what FA4 reads on Hopper ("auto": a float32 model falls back)


def _flash_attn_spec():
    try:
        return importlib.util.find_spec("flash_attn")
    except ValueError:  # a module in sys.modules without a spec
        return None


def flash_attn_available() -> bool:
    """flash-attn 2 (``flash_attn/__init__.py``): not the namespace package flash-attn-4 alone installs."""
    spec = _flash_attn_spec()
    return spec is not None and spec.origin not in (None, "namespace")


def fa4_available() -> bool:
    """flash-attn-4 (``flash_attn/cute``) is installed; found without importing it (CuTe DSL is slow to import)."""
    spec = _flash_attn_spec()
    dirs = (spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.isfile(os.path.join(d, "cute", "interface.py")) for d in dirs)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """A decided attention backend: what every rank builds, identically."""

    backend: str  # one of BACKENDS (never "auto")
    block_size: int
    kv_cache_dtype: str  # "auto" (the model's dtype), "bfloat16", "float16", "float32" or "fp8"

    def build(self) -> object:
        if self.backend == "torch":
            return TorchAttentionBackend()
        if self.backend == "triton":
            from rollout.layers.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend()
        if self.backend == "fa4":
            from rollout.layers.fa4_backend import FA4PrefillBackend

            return FA4PrefillBackend(self.block_size)
        from rollout.layers.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend(self.block_size)


def resolve_attention(
    name: str, device: torch.device, block_size: int = 16, kv_cache_dtype: str = "auto"
) -> AttentionSpec:
    """Check the choice and decide "auto". ``kv_cache_dtype`` other than "auto" (the model's dtype) keeps
    "auto" off flash-attn, which reads only a cache in the query's dtype; fp8 keeps it (and an explicit choice)
    off FA4 too. "auto" picks "fa4" only at ``block_size`` 128, the page FA4 loads by TMA (the measured speed-up);
    an explicit "fa4" takes any block size (FA4's slower cp.async pages, see ``rollout.layers.fa4_backend``)."""
    for backend, what in (("flash_attn", "flash-attn"), ("fa4", "FA4 (on Hopper)")):
        if name == backend and kv_cache_dtype == "fp8":
            raise ValueError(f"kv_cache_dtype='fp8' needs attention_backend 'triton', 'torch' or 'auto', not "
                             f"{backend!r}: {what} reads no cache with per-token fp8 scales")
    if name == "auto":
        if device.type != "cuda":
            name = "torch"
        elif fa4_available() and block_size == FA4_AUTO_BLOCK_SIZE and kv_cache_dtype in FA4_KV_DTYPES:
            name = "fa4"
        elif flash_attn_available() and block_size % 256 == 0 and kv_cache_dtype == "auto":
            name = "flash_attn"
        else:
            name = "triton"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; allowed: 'auto', 'torch', 'triton', 'flash_attn', "
                         "'fa4'")
    if name == "flash_attn" and not flash_attn_available():
        raise ValueError("attention_backend='flash_attn' but the flash-attn package is not installed")
    if name == "fa4" and not fa4_available():
        raise ValueError("attention_backend='fa4' but the flash-attn-4 package (flash_attn.cute) is not installed; "
                         "pip install 'rollout[fa4]'")
    if name != "torch" and device.type != "cuda":
        raise ValueError(f"attention_backend={name!r} needs a CUDA device, got {device.type!r}; "
                         "use 'torch' or 'auto' on the CPU")
    return AttentionSpec(name, block_size, kv_cache_dtype)
