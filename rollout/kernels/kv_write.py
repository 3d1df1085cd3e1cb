"""Store new tokens' K/V into the paged cache through ``slot_mapping``, in one Triton launch.

The torch path (two ``index_copy_`` calls plus a boolean filter for padding slots) needs a host
sync to drop ``-1`` slots; this kernel skips them on the device, so it can run inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, ck_ptr, cv_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_KV_HEADS)[:, None]
    dst = (
        (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    )
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(ck_ptr + dst, k.to(ck_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(cv_ptr + dst, v.to(cv_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as ``rollout.layers.attention.write_kv``: k, v [T, Hkv, D]; slots < 0 skipped."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, Hkv, D]; got {tuple(kv_cache.shape)}")
    _, _, page, hkv, d = kv_cache.shape
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (hkv, d):
        raise ValueError(f"k and v must be [T, {hkv}, {d}]; got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}]; got {tuple(slot_mapping.shape)}")
    if d & (d - 1) or page & (page - 1):
        raise ValueError(f"head_dim ({d}) and block_size ({page}) must be powers of two")
    if k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("k, v and kv_cache must have a contiguous last (head_dim) axis")
    if k.shape[0] == 0:
        return
    _kv_write_kernel[(k.shape[0],)](
        k, v, kv_cache[0], kv_cache[1], slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=hkv, H_PAD=triton.next_power_of_2(hkv), HEAD_DIM=d, PAGE=page,
        num_warps=1 if hkv * d <= 1024 else 4,
    )  # fmt: skip
