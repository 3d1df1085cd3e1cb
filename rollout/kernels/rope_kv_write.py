"""Rotary on q and k fused with the K/V store: one launch per layer where there were two.

``fused_rotary.rotary_qk_`` rotated q and k in place, then ``kv_write.write_kv_triton`` read k and v back and
stored them into the paged cache (fp8: quantized). Here the programs of a token's q heads rotate q in place, as
before, and one program per token rotates its k heads in registers and stores them, with v, straight into the
cache: k itself is left as the projection wrote it (nothing reads it after the store: every attention kernel
reads keys from the cache). Same numerics, bit for bit: the rotation in float32 with contraction off, rounded to
k's dtype, then the store or the fp8 quantization of those rounded values (a row's scale from the amax of both
rotated halves). A decode step's graph has 28 fewer nodes for a 28-layer model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.fused_rotary import BLOCK_H, _cos_sin, _rotate_block
from rollout.kernels.kv_write import _store_rows
from rollout.kernels.paged_common import KVPair, check_kv_layout, check_kv_scales, kv_args, round_to_e4m3
from rollout.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _store_half(x, c_ptr, dst, mask, sc, KV_FP8: tl.constexpr):
    """Half rows x [H_PAD, HALF] (k's dtype) -> the cache; fp8: divided by the rows' scales ``sc`` and rounded."""
    if KV_FP8:
        y = tl.math.div_rn(x.to(tl.float32), sc.to(tl.float32)[:, None])
        y = round_to_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
        tl.store(c_ptr + dst, y.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(c_ptr + dst, x.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, ck_ptr, cv_ptr, cks_ptr, cvs_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
    stride_ckb, stride_cks, stride_ckh,
    stride_cvb, stride_cvs, stride_cvh, stride_cvd,
    stride_sb, stride_ss, stride_sh,
    HQ, NQB,
    NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, KV_FP8: tl.constexpr, V_TRANS: tl.constexpr,
    SCALE_CONTIG: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0)
    blk = tl.program_id(1)
    c, s, offs_d, d_ok = _cos_sin(pos_ptr, cs_ptr, t, stride_c, HALF, HALF)  # head_dim a power of two: no lane off
    if blk < NQB:  # q heads: rotated in place, as fused_rotary does
        _rotate_block(q_ptr, stride_qt, stride_qh, t, blk * BLOCK_H, HQ, c, s, offs_d, d_ok, HALF, BLOCK_H)
    else:  # every kv head of the token: k rotated in registers, k and v into the cache
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # < 0: a padding token, nothing to store
            offs_h = tl.arange(0, H_PAD)
            h_ok = offs_h < NUM_KV_HEADS
            mask = h_ok[:, None]
            kp = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
            x1 = tl.load(kp, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(kp + HALF, mask=mask, other=0.0).to(tl.float32)
            o1 = (x1 * c[None, :] - x2 * s[None, :]).to(k_ptr.dtype.element_ty)
            o2 = (x2 * c[None, :] + x1 * s[None, :]).to(k_ptr.dtype.element_ty)
            page_blk, off = slot // PAGE, slot % PAGE
            k_dst = page_blk * stride_ckb + off * stride_cks + offs_h[:, None] * stride_ckh + offs_d[None, :]
            s_dst = page_blk * stride_sb + off * stride_ss + offs_h * stride_sh
            sc = tl.zeros([H_PAD], dtype=tl.float16)
            if KV_FP8:  # the row's scale over both rotated halves: kv_write's amax / 448, at least 2^-24
                amax = tl.maximum(tl.max(tl.abs(o1.to(tl.float32)), 1), tl.max(tl.abs(o2.to(tl.float32)), 1))
                sc = tl.maximum(tl.math.div_rn(amax, 448.0), 5.960464477539063e-08).to(tl.float16)
                tl.store(cks_ptr + s_dst, sc, mask=h_ok)
            _store_half(o1, ck_ptr, k_dst, mask, sc, KV_FP8)
            _store_half(o2, ck_ptr, k_dst + HALF, mask, sc, KV_FP8)
            offs_v = tl.arange(0, HEAD_DIM)
            v_dst = (page_blk * stride_cvb + off * stride_cvs + offs_h[:, None] * stride_cvh
                     + offs_v[None, :] * stride_cvd)  # fmt: skip
            v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :], mask=mask)
            _store_rows(v, cv_ptr, cvs_ptr, v_dst, s_dst, mask, h_ok, KV_FP8)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor | KVPair,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """q [T, Hq, D] rotated in place by ``cos_sin_cache[positions]``; k [T, Hkv, D] rotated the same way and
    stored with v into the cache through ``slot_mapping`` (slots < 0 skipped), as ``rotary_qk_`` then
    ``write_kv_triton`` would (k itself is left unrotated). An fp8 cache comes with its ``kv_scales`` view."""
    ck, _ = check_kv_layout(kv_cache)
    _, page, hkv, d = ck.shape
    t, hq, _ = q.shape
    if q.dim() != 3 or q.shape[2] != d or k.shape != v.shape or tuple(k.shape) != (t, hkv, d):
        raise ValueError(f"q must be [T, Hq, {d}] and k, v [T, {hkv}, {d}]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if d & (d - 1) or d < 16 or page & (page - 1):
        raise ValueError(f"head_dim ({d}) must be a power of two >= 16 and block_size ({page}) a power of two")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != d:
        raise ValueError(f"cos_sin_cache must be float32 [max_positions, {d}]; got {cos_sin_cache.dtype} "
                         f"{tuple(cos_sin_cache.shape)}")  # fmt: skip
    if positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(f"positions and slot_mapping must be [{t}]; got {tuple(positions.shape)}, "
                         f"{tuple(slot_mapping.shape)}")  # fmt: skip
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("q, k, v and cos_sin_cache must have a contiguous last axis")
    check_kv_scales(kv_cache, kv_scales)
    if t == 0:
        return
    ptrs, strides, consts = kv_args(kv_cache, kv_scales)
    nqb = triton.cdiv(hq, BLOCK_H)
    _rope_kv_write_kernel[(t, nqb + 1)](
        q, k, v, positions, cos_sin_cache, *ptrs, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        *strides,
        hq, nqb,
        NUM_KV_HEADS=hkv, H_PAD=triton.next_power_of_2(hkv), HEAD_DIM=d, HALF=d // 2, PAGE=page, BLOCK_H=BLOCK_H,
        **consts, num_warps=2 if hkv * d <= 1024 else 4, enable_fp_fusion=False, **pdl_launch(q.device),
    )  # fmt: skip
