"""What the paged kernels share: argument checks (errors name the bad value and what is allowed) and
the FP8 KV format's device-side rounding.

FP8 KV cache (``kv_cache_dtype="fp8"``): K and V are stored as float8_e4m3fn with one float16 scale
per (token, kv head), i.e. per row of ``head_dim`` values; see ``rollout.layers.kv_quant`` for why
that granularity. Kernels take the value view ``[2, num_blocks, block_size, Hkv, D]`` (fp8) and the
scale view ``[2, num_blocks, block_size, Hkv]`` (fp16) of the same per-layer storage.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.layers.kv_quant import FP8_DTYPE, FP8_MAX, SCALE_DTYPE, SCALE_MIN  # noqa: F401 - re-exported

LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def round_to_e4m3(x):
    """fp32 already clamped to [-448, 448] -> the nearest e4m3 value (ties to even), still in fp32.

    Converting an exactly representable value to fp8 is then exact on every backend; Triton 3.9's
    interpreter truncates fp32 -> fp8 conversions that cross a power of two, so the rounding is ours.
    """
    a = tl.abs(x)
    bits = a.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    y = a * 512.0  # subnormals (|x| < 2^-6) are multiples of 2^-9
    fl = tl.floor(y)
    frac = y - fl
    up = (frac > 0.5) | ((frac == 0.5) & ((fl.to(tl.int32) & 1) == 1))
    sub = (fl + up.to(tl.float32)) * (1.0 / 512.0)
    r = tl.where(a < 0.015625, sub, normal)
    return tl.where(x < 0, -r, r)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def check_kv_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """An fp8 cache needs its scales ([2, num_blocks, block_size, Hkv] fp16); other caches take none."""
    if is_fp8(kv_cache.dtype):
        if kv_scales is None or kv_scales.dtype != SCALE_DTYPE or kv_scales.shape != kv_cache.shape[:4]:
            got = None if kv_scales is None else (kv_scales.dtype, tuple(kv_scales.shape))
            raise ValueError(
                f"an fp8 kv_cache {tuple(kv_cache.shape)} needs kv_scales of shape {tuple(kv_cache.shape[:4])} "
                f"and dtype {SCALE_DTYPE}; got {got}"
            )
        if kv_scales.stride(3) != 1:
            raise ValueError("kv_scales must be contiguous over kv heads")
    elif kv_scales is not None:
        raise ValueError(f"kv_scales are only for an fp8 kv_cache, not {kv_cache.dtype}")


def check_paged_inputs(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, kv_scales: torch.Tensor | None = None
) -> None:
    """Shape/dtype checks shared by the paged kernels; errors name the bad value and what is allowed."""
    if q.dtype not in _DTYPES or (kv_cache.dtype not in _DTYPES and not is_fp8(kv_cache.dtype)):
        raise TypeError(
            f"q dtype {q.dtype} must be one of {_DTYPES}; kv_cache dtype {kv_cache.dtype} one of them or {FP8_DTYPE}"
        )
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"q must be [T, Hq, D] and kv_cache [2, num_blocks, block_size, Hkv, D]; got {tuple(q.shape)} "
            f"and {tuple(kv_cache.shape)}"
        )
    _, _, page, hkv, d = kv_cache.shape
    if q.shape[2] != d or d < 16 or d & (d - 1):
        raise ValueError(
            f"head_dim must be a power of two >= 16 and equal in q and kv_cache; got {q.shape[2]}, {d}"
        )
    if page < 8 or page & (page - 1):
        raise ValueError(f"block_size must be a power of two >= 8; got {page}")
    if q.shape[1] % hkv:
        raise ValueError(f"num q heads {q.shape[1]} must be a multiple of num kv heads {hkv}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise TypeError(
            f"block_tables must be a 2-D int32 tensor; got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("q and kv_cache must have a contiguous last (head_dim) axis")
    check_kv_scales(kv_cache, kv_scales)


def scale_args(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> tuple:
    """Kernel arguments for the scales: (k scales, v scales, block stride, slot stride); dummies when
    the cache is not fp8 (the kernels then never touch them)."""
    if kv_scales is None:
        return kv_cache, kv_cache, 0, 0
    return kv_scales[0], kv_scales[1], kv_scales.stride(1), kv_scales.stride(2)


def check_window(sliding_window: int | None) -> int:
    """Kernel form of the window: 0 = none."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1; got {sliding_window}")
    return int(sliding_window)


def dot_precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"
