"""Paged prefill attention: a batch of variable-length new-token runs against the paged KV cache.

Each sequence's new tokens attend causally to its cached prefix *and* to each other; their K/V are
already in the cache, so one loop over the sequence's pages covers both. Grid: (query block of
BLOCK_M tokens, query head, sequence). Prefill is compute-bound, so a program per query head is
fine (the g heads that share a kv head re-read the same tiles from L2). The same kernel is correct
for any mix: decode-like rows (q_len 1), fresh prompts, and chunks behind long cached prefixes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.paged_common import (
    LOG2E,
    KVPair,
    check_paged_inputs,
    check_window,
    dot_precision,
    kv_args,
    kv_shape,
    load_v_tile,
    scale_offsets,
    to_dot16,
    v_operand,
)


@triton.jit
def _prefill_tile(
    q, m_i, l_i, acc, start_n, hi, seq_len, q_pos, window, bt_row, kvh, qk_scale, k_ptr, v_ptr, ks_ptr, vs_ptr,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_sb, stride_ss, stride_sh, offs_n, offs_d,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, KV_FP8: tl.constexpr,
    V_TRANS: tl.constexpr, SCALE_CONTIG: tl.constexpr, DOT_PREC: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """One key tile of online softmax for a [BLOCK_M, D] query block (see paged_decode's ``_decode_tile``
    for the fp8 path and ``TAIL``)."""
    pos = start_n + offs_n
    kv_ok = pos < hi
    blk = tl.load(bt_row + pos // PAGE, mask=kv_ok, other=0).to(tl.int64)
    slot = pos % PAGE
    off = blk * stride_kb + slot * stride_ks + kvh * stride_kh
    k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=kv_ok[:, None], other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if KV_FP8:  # per-key scales on the score columns, per-value scales on P's columns
        s_off = scale_offsets(blk, slot, kvh, stride_sb, stride_ss, stride_sh, PAGE, SCALE_CONTIG)
        s = s * (tl.load(ks_ptr + s_off, mask=kv_ok, other=0.0).to(tl.float32) * qk_scale)[None, :]
        v_sc = tl.load(vs_ptr + s_off, mask=kv_ok, other=0.0).to(tl.float32)
    else:
        s = s * qk_scale  # log2 domain
    visible = kv_ok[None, :] & (pos[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        visible = visible & (pos[None, :] > q_pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_v_tile(v_ptr, blk, slot, pos, seq_len, kvh, kv_ok, offs_d, stride_vb, stride_vs, stride_vh,
                    stride_vd, PAGE, V_TRANS, TAIL)  # fmt: skip
    v = v_operand(v.to(q.dtype), kv_ok, V_TRANS, TAIL)
    if KV_FP8:  # relative to the tile's largest V scale (fp16 keeps its range; see paged_decode)
        v_top = tl.maximum(tl.max(v_sc, 0), 1.0e-30)
        pv = (p * (v_sc * (1.0 / v_top))[None, :]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC) * v_top
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    qk_scale, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_sb, stride_ss, stride_sh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, KV_FP8: tl.constexpr,
    V_TRANS: tl.constexpr, SCALE_CONTIG: tl.constexpr, DOT16: tl.constexpr, DOT_PREC: tl.constexpr,
    SKIP_SINGLE: tl.constexpr = False,
):  # fmt: skip
    mb = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    if SKIP_SINGLE:  # one-token queries are the split-KV decode kernel's (TritonAttentionBackend, mixed steps)
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len  # cached tokens before the first new one
    kvh = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < q_len
    q_pos = prefix + offs_m
    q_ptrs = q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    q = to_dot16(tl.load(q_ptrs, mask=row_ok[:, None], other=0.0), DOT16)  # fp8 K/V: fp16 products

    # Keys this block can see: causal upper bound of its last row; window lower bound of its first.
    hi = tl.minimum(seq_len, prefix + (mb + 1) * BLOCK_M)
    lo = 0
    if USE_WINDOW:
        lo = (tl.maximum(prefix + mb * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    full_end = (seq_len // BLOCK_N) * BLOCK_N  # tiles starting below it end within the sequence
    for start_n in range(lo, tl.minimum(hi, full_end), BLOCK_N):
        m_i, l_i, acc = _prefill_tile(
            q, m_i, l_i, acc, start_n, hi, seq_len, q_pos, window, bt_row, kvh, qk_scale, k_ptr, v_ptr, ks_ptr,
            vs_ptr,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd,
            stride_sb, stride_ss, stride_sh, offs_n, offs_d,
            PAGE, BLOCK_N, USE_WINDOW, KV_FP8, V_TRANS, SCALE_CONTIG, DOT_PREC, False,
        )  # fmt: skip
    for start_n in range(tl.maximum(lo, full_end), hi, BLOCK_N):  # at most one: it holds the sequence's end
        m_i, l_i, acc = _prefill_tile(
            q, m_i, l_i, acc, start_n, hi, seq_len, q_pos, window, bt_row, kvh, qk_scale, k_ptr, v_ptr, ks_ptr,
            vs_ptr,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd,
            stride_sb, stride_ss, stride_sh, offs_n, offs_d,
            PAGE, BLOCK_N, USE_WINDOW, KV_FP8, V_TRANS, SCALE_CONTIG, DOT_PREC, True,
        )  # fmt: skip

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_blocks(head_dim: int, page: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): 64x64 tiles, 3 stages were the best of six configs
    on the H200 at D = 128 (bench/kernels_bench.py --sweep-prefill: 270-300 TFLOP/s bf16)."""
    if head_dim <= 128:
        return 64, max(64, page), 4, 3
    return 64, max(32, page), 8, 2


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor | KVPair,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    kv_scales: torch.Tensor | None = None,
    skip_single: bool = False,
) -> torch.Tensor:
    """Causal attention of the new tokens q ([T, Hq, D]) over each sequence's paged context.

    ``max_query_len`` (a host int, >= every q_len) sizes the grid; rows of q beyond
    ``query_start_loc[-1]`` are left untouched in ``out``. ``block_m``/``block_n`` override the tile
    sizes (powers of two >= 16), e.g. to keep interpreter tests small. ``kv_scales`` goes with an fp8 cache.
    ``skip_single``: leave the rows of one-token sequences untouched (the caller computes them by decode).
    """
    check_paged_inputs(q, kv_cache, block_tables, kv_scales)
    window = check_window(sliding_window)
    num_tokens, hq, d = q.shape
    page, hkv, _ = kv_shape(kv_cache)
    batch = seq_lens.shape[0]
    if query_start_loc.shape != (batch + 1,) or block_tables.shape[0] != batch:
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)} must be [B + 1] and block_tables "
            f"{tuple(block_tables.shape)} [B, max_blocks] for B = {batch} sequences"
        )
    if out is None:
        out = torch.empty((num_tokens, hq, d), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1, (
        f"out {tuple(out.shape)} must match q {tuple(q.shape)}"
    )
    if batch == 0 or num_tokens == 0 or max_query_len <= 0:
        return out
    bm, bn, warps, stages = prefill_blocks(d, page)
    bm, bn = block_m or bm, block_n or bn
    for name, val in (("block_m", bm), ("block_n", bn)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16; got {val}")
    ptrs, strides, consts = kv_args(kv_cache, kv_scales, q)
    grid = (triton.cdiv(max_query_len, bm), hq, batch)
    _prefill_kernel[grid](
        q, *ptrs, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, window,
        q.stride(0), q.stride(1),
        *strides,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, PAGE=page, BLOCK_M=bm, BLOCK_N=bn, USE_WINDOW=window > 0,
        **consts, DOT_PREC=dot_precision(q), SKIP_SINGLE=skip_single,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
