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

from rollout.kernels.paged_common import LOG2E, check_paged_inputs, check_window, dot_precision, is_fp8, scale_args


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    qk_scale, window,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_sb, stride_ss,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, KV_FP8: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    mb = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if mb * BLOCK_M >= q_len:
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
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    # Keys this block can see: causal upper bound of its last row; window lower bound of its first.
    hi = tl.minimum(seq_len, prefix + (mb + 1) * BLOCK_M)
    lo = 0
    if USE_WINDOW:
        lo = (tl.maximum(prefix + mb * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for start_n in range(lo, hi, BLOCK_N):
        pos = start_n + offs_n
        kv_ok = pos < hi
        blk = tl.load(bt_row + pos // PAGE, mask=kv_ok, other=0).to(tl.int64)
        off = blk * stride_cb + (pos % PAGE) * stride_cs + kvh * stride_ch
        k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=kv_ok[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if KV_FP8:  # per-key scales (see paged_decode)
            s_off = blk * stride_sb + (pos % PAGE) * stride_ss + kvh
            s = s * (tl.load(ks_ptr + s_off, mask=kv_ok, other=0.0).to(tl.float32) * qk_scale)[None, :]
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
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=kv_ok[:, None], other=0.0).to(q.dtype)
        if KV_FP8:
            p = p * tl.load(vs_ptr + s_off, mask=kv_ok, other=0.0).to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

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
    kv_cache: torch.Tensor,
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
) -> torch.Tensor:
    """Causal attention of the new tokens q ([T, Hq, D]) over each sequence's paged context.

    ``max_query_len`` (a host int, >= every q_len) sizes the grid; rows of q beyond
    ``query_start_loc[-1]`` are left untouched in ``out``. ``block_m``/``block_n`` override the tile
    sizes (powers of two >= 16), e.g. to keep interpreter tests small. ``kv_scales`` goes with an fp8 cache.
    """
    check_paged_inputs(q, kv_cache, block_tables, kv_scales)
    window = check_window(sliding_window)
    num_tokens, hq, d = q.shape
    _, _, page, hkv, _ = kv_cache.shape
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
    grid = (triton.cdiv(max_query_len, bm), hq, batch)
    _prefill_kernel[grid](
        q, kv_cache[0], kv_cache[1], *scale_args(kv_cache, kv_scales)[:2], block_tables, query_start_loc,
        seq_lens, out,
        scale * LOG2E, window,
        q.stride(0), q.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        *scale_args(kv_cache, kv_scales)[2:],
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, PAGE=page, BLOCK_M=bm, BLOCK_N=bn, USE_WINDOW=window > 0,
        KV_FP8=is_fp8(kv_cache.dtype), DOT_PREC=dot_precision(q),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
