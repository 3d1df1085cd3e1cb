"""Fused rotary embedding of q and k, in place: one launch for every head of every token.

The torch path gathers cos/sin, chunks, multiplies and concatenates: about ten kernels for q and k
per layer. Here each program rotates a block of heads of one token, reading cos/sin straight from the
float32 ``[max_positions, head_dim]`` table (cos in the first half, sin in the second) at the token's
position. Layout is neox / rotate_half like ``rollout.layers.rotary.apply_rotary``, with the same
numerics: float32 math (contraction off, so products round as torch's separate ops do), then one
cast back. q and k may be strided views (slices of the fused qkv output). CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_H = 4


@triton.jit
def _rotate_block(ptr, stride_t, stride_h, t, h0, H, c, s, offs_d, d_ok, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr):  # fmt: skip
    heads = h0 + tl.arange(0, BLOCK_H)
    ok = (heads < H)[:, None] & d_ok[None, :]
    p1 = ptr + t * stride_t + heads[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0).to(tl.float32)
    o1 = x1 * c[None, :] - x2 * s[None, :]
    o2 = x2 * c[None, :] + x1 * s[None, :]
    tl.store(p1, o1.to(ptr.dtype.element_ty), mask=ok)
    tl.store(p1 + HALF, o2.to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _cos_sin(pos_ptr, cache_ptr, t, stride_c, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Token ``t``'s (cos, sin) rows of the table at its position, with their dims and lane mask."""
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cache_ptr + pos * stride_c + offs_d, mask=d_ok, other=0.0)
    s = tl.load(cache_ptr + pos * stride_c + HALF + offs_d, mask=d_ok, other=0.0)
    return c, s, offs_d, d_ok


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    HQ, HK, NQB,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    blk = tl.program_id(1)
    c, s, offs_d, d_ok = _cos_sin(pos_ptr, cache_ptr, t, stride_c, HALF, HALF_PAD)
    if blk < NQB:
        _rotate_block(q_ptr, stride_qt, stride_qh, t, blk * BLOCK_H, HQ, c, s, offs_d, d_ok, HALF, BLOCK_H)
    else:
        h0 = (blk - NQB) * BLOCK_H
        _rotate_block(k_ptr, stride_kt, stride_kh, t, h0, HK, c, s, offs_d, d_ok, HALF, BLOCK_H)


def rotary_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place by ``cos_sin_cache[positions]`` ([T] ints)."""
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        raise TypeError(f"q dtype {q.dtype} and k dtype {k.dtype} must match, one of {_DTYPES}")
    if cos_sin_cache.dtype != torch.float32:
        raise TypeError(f"cos_sin_cache must be float32; got {cos_sin_cache.dtype}")
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k must be [T, H, D] with equal T and D; got {tuple(q.shape)}, {tuple(k.shape)}")
    t, hq, d = q.shape
    if d % 2 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != d or cos_sin_cache.stride(1) != 1:
        raise ValueError(
            f"head_dim {d} must be even and cos_sin_cache [max_positions, {d}] with a contiguous last axis; "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{t}] int32/int64; got {tuple(positions.shape)} {positions.dtype}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k must have a contiguous last (head_dim) axis")
    if t == 0:
        return
    nqb, nkb = triton.cdiv(hq, BLOCK_H), triton.cdiv(k.shape[1], BLOCK_H)
    _rotary_kernel[(t, nqb + nkb)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        hq, k.shape[1], nqb,
        HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2), BLOCK_H=BLOCK_H,
        num_warps=1 if d <= 64 else 2, enable_fp_fusion=False,
    )  # fmt: skip
