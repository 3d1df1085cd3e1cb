"""Split-KV ("flash-decoding") paged attention for decode steps: one new token per sequence.

Decode is bound by HBM bandwidth: every step reads each sequence's whole K/V once. So one program
owns one (sequence, kv head, split) and serves *all* query heads of that kv head at once (GQA: the
[g, D] query block times the K tile is a small matrix product), which reads each KV byte once. Small
batches do not fill the GPU with B * Hkv programs, so the context is cut into ``num_splits`` slices
whose partial (out, log-sum-exp) pairs a second tiny kernel merges.

CUDA-graph safe: nothing reads tensor values on the host and every buffer's size comes from static
shapes (batch, heads, ``block_tables.shape[1]``), never from ``seq_lens``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 128
# Resident decode programs per SM on the H200 (bf16, head_dim 128, 4 warps, 2 stages), as inferred
# from the split sweep: going past one such wave leaves a partial second wave that cost up to 25%.
PROGRAMS_PER_SM = 4
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, window,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_ot, stride_oh,
    stride_pb, stride_ph, stride_ps,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = 0
    if USE_WINDOW:  # the one query sits at position seq_len - 1 and sees keys in (pos - window, pos]
        start = tl.maximum(seq_len - window, 0)
    # Work is dealt in whole BLOCK_N tiles; every tile in [tile_lo, tile_hi) holds a visible key.
    tile_lo = start // BLOCK_N
    tile_hi = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
    t0 = tile_lo + split * per_split
    t1 = tl.minimum(t0 + per_split, tile_hi)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_ok = offs_g < GROUP
    q = tl.load(
        q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None], other=0.0
    )

    m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile cannot make NaNs
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for t in range(t0, t1):
        pos = t * BLOCK_N + offs_n
        ok = (pos < seq_len) & (pos >= start)
        blk = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
        off = blk * stride_cb + (pos % PAGE) * stride_cs + kvh * stride_ch
        k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # log2 domain
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        base = b * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_ok[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + base, lse, mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < NUM_SPLITS
    base = b * stride_pb + h * stride_ph + offs_s  # stride over splits is 1
    lse = tl.load(part_lse_ptr + base, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty sequence: every weight is exp2(-inf) = 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    o = tl.load(part_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty))


def check_paged_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor) -> None:
    """Shape/dtype checks shared by the paged kernels; errors name the bad value and what is allowed."""
    if q.dtype not in _DTYPES or kv_cache.dtype != q.dtype:
        raise TypeError(f"q dtype {q.dtype} and kv_cache dtype {kv_cache.dtype} must match, one of {_DTYPES}")
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


def check_window(sliding_window: int | None) -> int:
    """Kernel form of the window: 0 = none."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1; got {sliding_window}")
    return int(sliding_window)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; CPU (the Triton interpreter) gets a small stand-in."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_num_splits(batch: int, num_kv_heads: int, max_tiles: int, sms: int) -> int:
    """Splits per (sequence, kv head): as many as fit in one wave of PROGRAMS_PER_SM programs per SM.

    On the H200 (bench/kernels_bench.py --sweep-splits, llama3-8b shape) this picked the best or
    near-best split count for B = 1..256: a full single wave beats a wave and a bit. Depends only on
    static shapes (``max_tiles`` comes from ``block_tables.shape[1]``), so a CUDA graph captured for a
    batch size stays valid for any context lengths replayed into it.
    """
    slots = PROGRAMS_PER_SM * sms
    return max(1, min(slots // max(1, batch * num_kv_heads), MAX_SPLITS, max_tiles))


def decode_block_n(page: int, head_dim: int) -> int:
    """Key tile: a whole number of pages, about 64 tokens (32 for very wide heads)."""
    return max(page, 64 if head_dim <= 128 else 32, 16)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence (q: [B, Hq, D]) over its ``seq_lens[i]`` cached tokens.

    The new token's K/V must already be in the cache. A sequence with ``seq_len == 0`` (CUDA-graph
    padding) gets zeros. Returns ``out`` ([B, Hq, D], q's dtype).
    """
    check_paged_inputs(q, kv_cache, block_tables)
    window = check_window(sliding_window)
    batch, hq, d = q.shape
    _, _, page, hkv, _ = kv_cache.shape
    if seq_lens.shape != (batch,) or block_tables.shape[0] != batch:
        raise ValueError(
            f"decode needs one query per sequence: q has {batch} rows, seq_lens {tuple(seq_lens.shape)}, "
            f"block_tables {tuple(block_tables.shape)}"
        )
    if out is None:
        out = torch.empty((batch, hq, d), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1, (
        f"out {tuple(out.shape)} must match q {tuple(q.shape)}"
    )
    if batch == 0:
        return out
    group = hq // hkv
    block_n = decode_block_n(page, d)
    max_tiles = max(1, -(-block_tables.shape[1] * page // block_n))
    if num_splits is None:
        num_splits = choose_num_splits(batch, hkv, max_tiles, num_sms(q.device))
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024]; got {num_splits}")
    part_o = part_lse = out  # unused placeholders when there is a single split
    if num_splits > 1:
        part_o = torch.empty((batch, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    sp = (hq * num_splits, num_splits, 1) if num_splits > 1 else (0, 0, 0)
    _decode_split_kernel[(batch, hkv, num_splits)](
        q, kv_cache[0], kv_cache[1], block_tables, seq_lens, out, part_o, part_lse,
        scale * LOG2E, window,
        q.stride(0), q.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *sp,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, PAGE=page,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, USE_WINDOW=window > 0,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(batch, hq)](
            part_o, part_lse, out, sp[0], sp[1], out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=d, num_warps=4,
        )  # fmt: skip
    return out
