"""The FP8 KV cache format: e4m3 values with one float16 scale per (token, kv head), torch side.

Granularity: one scale per row of ``head_dim`` values (a token's K, or V, in one kv head), set to
amax(|row|) / 448 when the row is written. So the row's largest value maps to e4m3's largest and
nothing ever saturates, whatever the layer or position (K carries outlier channels and RoPE mixes
them; per-layer static scales would need calibration and still clip); the scale is known from the
row alone, so the write kernel computes it in registers with no calibration pass and no rescaling
of earlier tokens; and it costs 2 bytes per 128 values: a token-head is 130 bytes against bf16's 256,
1.97x the capacity (the fp8 values keep e4m3's ~6% relative precision within each row).

Layout: each layer's cache is one uint8 tensor ``[2, num_blocks, block_bytes]`` (0 = K, 1 = V) so
that a block copy (copy-on-write of a shared block) moves values and scales together. Inside a block
each half holds its ``block_size x Hkv x D`` fp8 values first, then its ``Hkv x block_size`` fp16
scales (one kv head's scales for the block are contiguous: a decode tile loads them in a few wide
loads). K's values are token-major ``[block_size, Hkv, D]`` (D contiguous: QK^T contracts over D);
V's are stored transposed, ``[Hkv, D, block_size]`` (tokens contiguous: PV contracts over tokens, and
an 8-bit tensor-core operand must be contiguous along its contraction axis; token-major fp8 V made
the decode kernel gather it byte by byte from shared memory). ``fp8_views`` gives logical views of
both, ``[num_blocks, block_size, Hkv, D]`` each, whatever the physical order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.float16
SCALE_MIN = 2.0**-24  # smallest float16 subnormal: an all-zero row still gets a nonzero scale


def fp8_token_head_bytes(head_dim: int) -> int:
    """Bytes per (token, kv head) row: the values plus the scale."""
    return head_dim + SCALE_DTYPE.itemsize


def fp8_block_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    return block_size * num_kv_heads * fp8_token_head_bytes(head_dim)


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    """A per-layer cache in the fp8 layout (raw bytes) rather than ``[2, blocks, page, Hkv, D]``."""
    return kv_cache.dtype == torch.uint8


class KVPair(NamedTuple):
    """An fp8 cache's K and V values as logical ``[num_blocks, block_size, Hkv, D]`` views (V strided)."""

    k: torch.Tensor
    v: torch.Tensor


def kv_halves(kv_cache: torch.Tensor | KVPair) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) ``[num_blocks, block_size, Hkv, D]`` of a ``[2, ...]`` cache or a ``KVPair``."""
    return kv_cache[0], kv_cache[1]


def fp8_views(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[KVPair, torch.Tensor]:
    """Raw ``[2, num_blocks, block_bytes]`` -> (values ``KVPair`` of fp8 ``[nb, page, Hkv, D]`` views,
    scales ``[2, nb, page, Hkv]`` fp16 view), all views of the same memory."""
    two, nb, nbytes = kv_cache.shape
    row = num_kv_heads * fp8_token_head_bytes(head_dim)
    if two != 2 or nbytes % row or kv_cache.stride(2) != 1:
        raise ValueError(
            f"fp8 kv_cache must be [2, num_blocks, block_size * {row}] contiguous bytes for {num_kv_heads} kv "
            f"heads of dim {head_dim}; got {tuple(kv_cache.shape)}"
        )
    page = nbytes // row
    split = page * num_kv_heads * head_dim
    k = kv_cache[0, :, :split].view(FP8_DTYPE).view(nb, page, num_kv_heads, head_dim)
    v = kv_cache[1, :, :split].view(FP8_DTYPE).view(nb, num_kv_heads, head_dim, page).permute(0, 3, 1, 2)
    scales = kv_cache[..., split:].view(SCALE_DTYPE).view(2, nb, num_kv_heads, page).transpose(2, 3)
    return KVPair(k, v), scales


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 values [..., D], float16 scales [...]); the Triton KV-store kernel's rule."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / FP8_MAX).clamp(min=SCALE_MIN).to(SCALE_DTYPE)
    values = (xf / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, scale


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(e4m3 [..., D], fp16 [...]) -> float32 [..., D]."""
    return values.float() * scales.float()[..., None]
