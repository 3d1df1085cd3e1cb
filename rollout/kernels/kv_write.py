"""Store new tokens' K/V into the paged cache through ``slot_mapping``, in one Triton launch.

The torch path (two ``index_copy_`` calls plus a boolean filter for padding slots) needs a host
sync to drop ``-1`` slots; this kernel skips them on the device, so it can run inside a CUDA graph.
For an fp8 cache it also quantizes, in registers: each (token, kv head) row of ``head_dim`` values
gets the scale amax / 448 (stored as float16), so its largest value maps to e4m3's largest and
nothing saturates; V's bytes go to their token-contiguous places (``rollout.layers.kv_quant``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.paged_common import KVPair, check_kv_layout, check_kv_scales, kv_args, round_to_e4m3


@triton.jit
def _store_rows(x, c_ptr, cs_ptr, dst, s_dst, mask, h_ok, KV_FP8: tl.constexpr):
    """Rows x [H_PAD, D] -> the cache at ``dst``; fp8: quantized, with their scales at ``s_dst``."""
    if KV_FP8:
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), 1)
        # amax / 448, at least 2^-24 (paged_common.FP8_MAX, SCALE_MIN); IEEE division like torch's
        sc = tl.maximum(tl.math.div_rn(amax, 448.0), 5.960464477539063e-08).to(tl.float16)
        y = tl.math.div_rn(xf, sc.to(tl.float32)[:, None])
        y = round_to_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
        tl.store(c_ptr + dst, y.to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(cs_ptr + s_dst, sc, mask=h_ok)
    else:
        tl.store(c_ptr + dst, x.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, ck_ptr, cv_ptr, cks_ptr, cvs_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckb, stride_cks, stride_ckh,
    stride_cvb, stride_cvs, stride_cvh, stride_cvd,
    stride_sb, stride_ss, stride_sh,
    NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    KV_FP8: tl.constexpr, V_TRANS: tl.constexpr, SCALE_CONTIG: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    h_ok = offs_h < NUM_KV_HEADS
    mask = h_ok[:, None]
    blk, off = slot // PAGE, slot % PAGE
    k_dst = blk * stride_ckb + off * stride_cks + offs_h[:, None] * stride_ckh + offs_d[None, :]
    v_dst = blk * stride_cvb + off * stride_cvs + offs_h[:, None] * stride_cvh + offs_d[None, :] * stride_cvd
    s_dst = blk * stride_sb + off * stride_ss + offs_h * stride_sh
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    _store_rows(k, ck_ptr, cks_ptr, k_dst, s_dst, mask, h_ok, KV_FP8)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    _store_rows(v, cv_ptr, cvs_ptr, v_dst, s_dst, mask, h_ok, KV_FP8)


def write_kv_triton(
    kv_cache: torch.Tensor | KVPair,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Same contract as ``rollout.layers.attention.write_kv``: k, v [T, Hkv, D]; slots < 0 skipped.
    An fp8 cache (a ``KVPair`` of value views) comes with its ``kv_scales`` view."""
    ck, _ = check_kv_layout(kv_cache)
    _, page, hkv, d = ck.shape
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (hkv, d):
        raise ValueError(f"k and v must be [T, {hkv}, {d}]; got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}]; got {tuple(slot_mapping.shape)}")
    if d & (d - 1) or page & (page - 1):
        raise ValueError(f"head_dim ({d}) and block_size ({page}) must be powers of two")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must have a contiguous last (head_dim) axis")
    check_kv_scales(kv_cache, kv_scales)
    if k.shape[0] == 0:
        return
    ptrs, strides, consts = kv_args(kv_cache, kv_scales)
    _kv_write_kernel[(k.shape[0],)](
        k, v, *ptrs, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *strides,
        NUM_KV_HEADS=hkv, H_PAD=triton.next_power_of_2(hkv), HEAD_DIM=d, PAGE=page, **consts,
        num_warps=1 if hkv * d <= 1024 else 4,
    )  # fmt: skip
