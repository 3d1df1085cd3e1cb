"""Split-KV ("flash-decoding") paged attention for decode steps: one new token per sequence.

Decode is bound by HBM bandwidth: every step reads each sequence's whole K/V once, so the kernel's job
is to keep every SM streaming until the last byte. Three choices do that:

* GQA packing: one program owns one (work item, kv head) and serves *all* g query heads of that kv
  head as a [g, D] tile (the g x BLOCK_N scores are one small matrix product), so each KV byte is
  read once per step, not g times.
* Work balanced over the *live* context lengths: RL batches are long-tailed (W2: hundreds of
  sequences, 256 to 16K tokens), and one program per sequence leaves the GPU waiting on the longest.
  Each program instead takes a chunk of at most ``c`` key tiles of one sequence, where
  ``c = max(min_chunk, ceil(total live tiles / split_target))``; a sequence of t tiles gets
  ``ceil(t / c)`` equal chunks. Every program works out ``c`` and its own (sequence, chunk) from
  ``seq_lens`` on the device (a prefix sum over the batch, a few hundred ints from L2), so the
  partition follows the live lengths step by step while the grid stays fixed.
* A fixed grid of ``batch + split_target`` programs per kv head bounds the chunk count (the sum of
  ceil(t_b / c) is below total / c + batch), so buffers and grid depend only on the batch size: a
  CUDA graph captured per batch size replays correctly for any context lengths (nothing is decided
  on the host, nothing is bucketed). ``split_target`` defaults to a few waves of resident programs,
  so the GPU's block scheduler balances chunks dynamically and the last wave is short.

A sequence cut into one chunk writes its output directly; the others write fp32 partial (out,
log-sum-exp) pairs that a small second kernel merges, and it skips unsplit sequences at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.paged_common import (  # noqa: F401 - re-exported for callers of the old home
    LOG2E,
    KVPair,
    check_paged_inputs,
    check_window,
    dot_precision,
    is_fp8,
    kv_args,
    kv_shape,
    load_v_pages,
    load_v_tile,
    scale_offsets,
    to_dot16,
    v_operand,
)
from rollout.kernels.pdl import pdl_enter, pdl_launch

# Resident decode programs per SM on the H200 (bf16, head_dim 128, 4 warps, 2 stages), as inferred
# from the split sweep of the previous, per-batch split heuristic (bench/results/kernels_*_h200.jsonl).
PROGRAMS_PER_SM = 4
DECODE_WAVES = 4  # split_target = this many waves of resident programs (per kv head's share)
UNIFORM_MAX_OVER_MEAN = tl.constexpr(2)  # lengths this even (longest <= 2 x mean) get one wave (_find_chunk)
MIN_CHUNK_TILES = 2  # below ~128 keys a chunk's partial write and merge cost more than they balance
MAX_SPLITS = 128  # old fixed-split heuristic's cap (bench A/B only)
SCAN = 256  # sequences per step of the in-kernel prefix sum
S_BLOCK = 16  # partials merged per step of the reduce loop
# Whether the products run swapped (the key tile as the tensor cores' M side: _decode_tile_t), per cache kind.
# H200, qwen2.5-1.5b, long-tail to 16K (bench/results/h200_2026-12-02_kernels_swap_ab.jsonl): fp8 1.07-1.08x
# faster swapped (B=256: 0.258 vs 0.279 ms), bf16 1.01-1.04x slower, so only fp8 swaps.
SWAP_AB = {"16bit": False, "fp8": True}
# Token-contiguous (fp8) V copied page by page in the swapped kernel (paged_decode_attention's v_pages): a [pages,
# D, PAGE] load whose copy instructions each read 32 consecutive dims of one page (512 contiguous bytes), where the
# [D, BLOCK_N] load spread a copy's lanes over several pages and moved twice the ideal L2 sectors (Nsight Compute
# on the H200, docs/benchmarks.md 2026-12-03). On: W2 with fp8 KV, same run (H200, 982d2c7): 1.223x bf16's tok/s
# against 1.119x without (e44d04c), mean decode compute 5.35 vs 5.72 ms, logprob gap 2.74x (bench/results/
# h200_2026-12-03_w2_vpages_982d2c7.jsonl).
V_PAGES = True
# The last chunk of a split sequence merges its partials (an atomic counter per sequence and kv head) instead of a
# second kernel per layer (paged_decode_attention's fused_merge). H200 at e44d04c, without a plan: 1.1% faster at
# B=256, 1.1% slower at B=128 (bench/results/h200_2026-12-03_kern_e44d04c.jsonl); with a plan the counters are
# zeroed once per step. On since the H100 at 8858c88 (bench/results/h100_2026-12-07f_*): W1 0.906 of the floor
# against 0.899 in the same call, a W2-shaped bf16 step 0.2% (B=128) and 1.2% (B=256) shorter, fp8 unchanged.
FUSED_MERGE = True
# A decode step whose live lengths are even (longest <= 2 x mean; the caller knows them on the host, so each
# kind replays its own graph) takes the fixed split count of ``choose_num_splits`` for its batch size: on even
# lengths the balanced partition found nothing to balance yet paid its plan and reduce launches, 1-3% slower than
# the fixed split (W1-short, W3: docs/benchmarks.md). Long tails keep the balanced partition.
EVEN_FIXED_SPLIT = True
FP8_DECODE_MAXNREG = 168  # registers per thread of the fp8 decode kernel (decode_config)
# Resident programs per SM of the fp8 decode kernel (two warps at 168 registers: 65536 // (64 x 168) = 6;
# bench/kernel_sass.py and Nsight Compute agree). The even split sized for bf16's PROGRAMS_PER_SM left a third of
# fp8's slots empty: every W2 step has even lengths (bench/w2_lengths.py), so W2 with fp8 KV decoded on it.
FP8_PROGRAMS_PER_SM = 6
# The even split's count (even_num_splits): chunks per sequence for EVEN_WAVES waves of resident programs, at most
# EVEN_MAX_SPLITS, never fewer than one wave's (the previous rule). One wave left each program a whole sequence's
# share, so the longest of a step's even lengths (up to 2 x mean) set the step's time. H200, qwen2.5-1.5b, lengths in
# [ctx / 3, ctx] at 8K (bench/results/h200_2026-12-03e_kernels_even_split_304158d.jsonl), fixed counts against one
# wave's: bf16 B=128 / 200 / 256 best at 12 / 8 / 8 chunks (1.08 / 1.11 / 1.03x faster than one wave), fp8 at 12 /
# 8 / 8 (1.03 / 1.45 / 1.24x). In W2 (h200_2026-12-03e_w2_*.jsonl): 8 chunks took fp8 KV to 1.247x bf16 (1.151x
# at one wave); 6 waves uncapped (fp8 9-18 chunks) to 1.198x; bf16 0.757 / 0.760 of the floor either way.
EVEN_WAVES = 6
EVEN_MAX_SPLITS = 8
# ... and no chunk of the even split under this many key tiles (512 keys at BLOCK_N 64) unless one wave needs it: a
# sequence of t tiles takes min(num_splits, max(one wave's count, ceil(t / this))) chunks, and the rest of its
# programs return at once. Short contexts cut finer cost more in partial writes and merges than they balance:
# W1-short / W3 (1K) at 8 chunks of ~2 tiles ran 0.96 / 0.83x the one-wave split (h200_2026-12-03e_legacy_3ba43f7).
# Nor more chunks than the graph's longest context (max_model_len) holds at this size: W1-short (1,168 tokens, 19
# tiles) at 8 chunks with this minimum (2-3 working, the rest returning) ran 0.978x legacy's 2
# (h200_2026-12-03f_legacy_e827763).
EVEN_MIN_CHUNK_TILES = 8
# The same minimum for an fp8 cache. W2's decode steps at 256 sequences (mean context ~2K, bench/w2_lengths.py) ran
# 5.153 ms with 8 chunks of ~4 tiles (3ba43f7, no minimum) against 5.352 ms with this minimum at 8 (e827763, ~4
# chunks): fp8's kernel, six programs an SM, wants the extra programs there. At 4 (with EVEN_MIN_ROWS=128 in the
# session of 2026-12-03, h200_2026-12-03g_w2_knobs_0e4691e.jsonl) the 256-sequence bucket took 5.266 ms against
# 5.352 at 8, bf16 unchanged; the smaller buckets' loss in that run is EVEN_MIN_ROWS's (see there).
FP8_EVEN_MIN_CHUNK_TILES = 4
# Even lengths take the fixed split only from this many (sequence, kv head) rows; below, the balanced partition,
# which cut W2-like even lengths 4-10% faster than any fixed count at B=32 with 2 kv heads (64 rows; the kernel
# sweep above). In W2 at 128 (h200_2026-12-03g_w2_knobs_0e4691e.jsonl) fp8's steps under 64 sequences ran 2.5-3%
# slower (2.769 / 4.533 ms against 2.691 / 4.423), bf16's 1% faster: the kernel sweep's edge does not survive the
# engine, so 0: every even step is fixed.
EVEN_MIN_ROWS = 0
# Uniform lengths (``even_lengths=2``: the longest within 1/8 of the shortest, as every step of W1, W1-short and W3)
# take one wave's count with no minimum chunk, the rule the llama3-8b sweep of 2026-11-29 chose for B = 1..256:
# equal chunks of equal sequences fill one wave exactly, so more chunks only add partials to write and merge. W1
# (t1) on the H200: 9.140 ms a step, 0.833 of the floor, with it (h200_2026-12-03g_w1uniform_0e4691e.jsonl) against
# 9.494 ms, 0.802, on the even rule (h200_2026-12-03f_w1_cff1531.jsonl). False: uniform steps take the even rule.
UNIFORM_ONE_WAVE = True
# The stream split (paged_decode_stream.py): one wave of programs, each streaming an equal run of the step's key
# tiles across sequences, for every decode call without an explicit num_splits (even lengths included); STREAM_K for
# 16-bit caches, STREAM_K_FP8 for fp8. H100 at 3de8f38, qwen2.5-1.5b (bench/results/h100_2026-12-07c_kernels_stream_
# 3de8f38.jsonl), one wave against the engine's rule: fp8 1.070x faster on W2's 256-sequence steps (even lengths in
# [1K, 3K]: 0.1298 vs 0.1389 ms), 1.011x / 1.023x on the 16K long tail at B=256 / 128; bf16 0.879x / 0.880x / 0.890x
# (two waves: 0.970x / 0.994x / 0.987x). In the engine, W2 with fp8 KV on it (H100, 263f594, --decode-knobs
# STREAM_K_FP8=1): 21,419 tok/s against 20,115 on the even rule (2220a74), 1.433x bf16 in the same run (bar 1.3x;
# bench/results/h100_2026-12-07d_w2_streamfp8_263f594.jsonl), so fp8 takes it. bf16 stays on its rules: W1 with
# STREAM_K=1 at 4 programs an SM ran 0.789 of the floor against 0.879 (h100_2026-12-07d_w1_streambf16_4739d05).
STREAM_K = False
STREAM_K_FP8 = True
# Programs per SM of a 16-bit cache's stream wave (an fp8 cache's is FP8_PROGRAMS_PER_SM). The bf16 stream kernel
# takes 153 registers a thread where the chunked one takes 96 (bench/kernel_sass.py --kernel split,stream with the
# device's Triton 3.6): 3 resident programs an SM, not 5. So a wave "of 4" was 1.33 waves, and the fastest bf16
# variant timed, 6 an SM, is two full waves of 3 (H100, 4739d05, h100_2026-12-07d_kernels_stream_4739d05.jsonl):
# W2's 256-sequence steps (even [1K, 3K]) 0.2075 ms against 0.2376 at 4 and 0.2091 for the even rule; the 16K long
# tail at B=256 / 128 0.4105 / 0.2410 against the rule's 0.4163 / 0.2458. Untimed in the engine: STREAM_K stays off.
STREAM_PROGRAMS_PER_SM = 6
# Registers per thread the 16-bit stream kernel may take (0: as many as it wants, 153). 128 fits 4 programs an SM
# (4 spill loads in its key-tile loop), 96 fits 5 (5 spill loads); kernels_bench --compare-stream times both
# against the uncapped kernel's 2 waves of 3.
STREAM_MAXNREG = 0
# The 16-bit stream kernel's key tile and warps (0: decode_config's, 64 keys and 4 warps; a tile never smaller
# than a page). 32 keys x 4 warps takes 96 registers (5 an SM), 64 x 8 warps 108 (2 an SM, 16 warps):
# kernels_bench --compare-stream's stream_c* variants time them.
STREAM_BLOCK_N = 0
STREAM_WARPS = 0


@triton.jit
def _tile_range(seq_len, window, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """Key tiles [lo, hi) holding a visible key of the query at position seq_len - 1."""
    lo = seq_len * 0
    if USE_WINDOW:  # the query sees keys in (pos - window, pos]
        lo = tl.maximum(seq_len - window, 0) // BLOCK_N
    return lo, (seq_len + BLOCK_N - 1) // BLOCK_N


@triton.jit
def _tile_scales(t, bt_row, seq_len, kvh, ks_ptr, vs_ptr, stride_sb, stride_ss, stride_sh, offs_n,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
                 SCALE_CONTIG: tl.constexpr):  # fmt: skip
    """fp8: key tile ``t``'s per-token K and V scales ([BLOCK_N] fp32; 0 past ``seq_len``), loaded a
    tile ahead by the caller (Triton pipelines the K/V copies, not these small loads, and the scores
    need them right after the first dot). Non-fp8: dummies."""
    if KV_FP8:
        pos = t * BLOCK_N + offs_n
        ok = pos < seq_len
        blk = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
        s_off = scale_offsets(blk, pos % PAGE, kvh, stride_sb, stride_ss, stride_sh, PAGE, SCALE_CONTIG)
        k_sc = tl.load(ks_ptr + s_off, mask=ok, other=0.0).to(tl.float32)
        v_sc = tl.load(vs_ptr + s_off, mask=ok, other=0.0).to(tl.float32)
    else:
        k_sc = tl.zeros([BLOCK_N], dtype=tl.float32)
        v_sc = k_sc
    return k_sc, v_sc


@triton.jit
def _decode_tile(
    q, m_i, l_i, acc, t, bt_row, seq_len, start, kvh, qk_scale, k_sc, v_sc, k_ptr, v_ptr,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd, offs_n, offs_d,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, V_TRANS: tl.constexpr,
    DOT_PREC: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """One key tile of online softmax for the [G, D] queries of one kv head: (m_i, l_i, acc) updated.
    fp8: K and V widen in registers where the dots consume them; the per-token scales (``k_sc``,
    ``v_sc``, from ``_tile_scales``) scale the score columns (K) and P's columns (V)."""
    pos = t * BLOCK_N + offs_n
    ok = (pos < seq_len) & (pos >= start)
    blk = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
    slot = pos % PAGE
    off = blk * stride_kb + slot * stride_ks + kvh * stride_kh
    k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if KV_FP8:  # per-key scale: scaling the score columns is the same as scaling K's rows
        s = s * (k_sc * qk_scale)[None, :]
    else:
        s = s * qk_scale  # log2 domain
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_v_tile(v_ptr, blk, slot, pos, seq_len, kvh, ok, offs_d, stride_vb, stride_vs, stride_vh, stride_vd,
                    PAGE, V_TRANS, TAIL)  # fmt: skip
    v = v_operand(v.to(q.dtype), ok, V_TRANS, TAIL)
    if KV_FP8:  # per-value scale on P's columns, relative to the tile's largest (fp16 keeps its range)
        v_top = tl.maximum(tl.max(v_sc, 0), 1.0e-30)
        pv = (p * (v_sc * (1.0 / v_top))[None, :]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC) * v_top
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _decode_tile_t(
    q_t, m_i, l_i, acc_t, t, bt_row, seq_len, start, kvh, qk_scale, k_sc, v_sc, k_ptr, v_ptr,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd, offs_n, offs_d,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, V_TRANS: tl.constexpr,
    DOT_PREC: tl.constexpr, TAIL: tl.constexpr, V_PAGES: tl.constexpr = False,
):  # fmt: skip
    """``_decode_tile`` with the products swapped ("swap AB"): scores as K [BLOCK_N, D] x q^T [D, G],
    output as V^T [D, BLOCK_N] x P^T [BLOCK_N, G], so the key tile is the products' M side (a
    tensor-core tile of 64 rows per warp group, fed from the registers where K and V were widened) and
    the few query heads of a kv head are the N side (8 wide, not padded to 16 rows). Token-contiguous
    (fp8) V is already V^T. (m_i, l_i) are per query head; ``acc_t`` is [D, G]."""
    pos = t * BLOCK_N + offs_n
    ok = (pos < seq_len) & (pos >= start)
    blk = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
    slot = pos % PAGE
    off = blk * stride_kb + slot * stride_ks + kvh * stride_kh
    k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0).to(q_t.dtype)
    s = tl.dot(k, q_t, input_precision=DOT_PREC)  # [BLOCK_N, G]
    if KV_FP8:
        s = s * (k_sc * qk_scale)[:, None]
    else:
        s = s * qk_scale
    s = tl.where(ok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    if V_PAGES and V_TRANS and not TAIL:  # page by page: each copy instruction reads one page's dims in a row
        v = load_v_pages(v_ptr, bt_row, t, kvh, offs_d, stride_vb, stride_vs, stride_vh, stride_vd, PAGE, BLOCK_N)
    else:
        v = load_v_tile(v_ptr, blk, slot, pos, seq_len, kvh, ok, offs_d, stride_vb, stride_vs, stride_vh, stride_vd,
                        PAGE, V_TRANS, TAIL)  # fmt: skip
    v = v.to(q_t.dtype)
    if V_TRANS:
        if TAIL:
            v = tl.where(ok[None, :], v, 0.0)
    else:
        v = tl.trans(v)
    if KV_FP8:
        v_top = tl.maximum(tl.max(v_sc, 0), 1.0e-30)
        pv = (p * (v_sc * (1.0 / v_top))[:, None]).to(q_t.dtype)
        acc_t = acc_t * alpha[None, :] + tl.dot(v, pv, input_precision=DOT_PREC) * v_top
    else:
        acc_t = acc_t * alpha[None, :] + tl.dot(v, p.to(q_t.dtype), input_precision=DOT_PREC)
    return m_new, l_i, acc_t


@triton.jit
def _merge_chunks(part_o_ptr, part_lse_ptr, out_ptr, first, n, b, heads, g_ok, offs_d, num_heads, stride_ot,
                  stride_oh, HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr):  # fmt: skip
    """Merge chunks [first, first + n)'s (out, lse) partials of one kv head's query heads into ``out``;
    the partials come from other programs, read through L2 (``.cg``: an SM's L1 is not coherent)."""
    m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    den = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
    for c in range(first, first + n):
        row = (c * num_heads + heads).to(tl.int64)
        lse = tl.load(part_lse_ptr + row, mask=g_ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=g_ok[:, None], other=0.0,
                    cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights exp2(-inf) = 0
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse - m_ref)
        acc = acc * alpha[:, None] + o * w[:, None]
        den = den * alpha + w
        m = m_new
    res = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    o_ptrs = out_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _chunk_attention(
    q, t0, t1, bt_row, seq_len, start, kvh, qk_scale, k_ptr, v_ptr, ks_ptr, vs_ptr,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd, stride_sb, stride_ss, stride_sh,
    offs_n, offs_d, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr, V_TRANS: tl.constexpr, SCALE_CONTIG: tl.constexpr, DOT_PREC: tl.constexpr,
    SWAP_AB: tl.constexpr, V_PAGES: tl.constexpr,
):  # fmt: skip
    """Online softmax of one kv head's [G, D] queries over key tiles [t0, t1) of one sequence (its block-table
    row ``bt_row``): (m_i, l_i, acc [G, D]), unnormalised. The tiles that end within the sequence run unmasked
    V loads; the tile holding its end (at most one) runs last, masked (``TAIL``)."""
    m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile cannot make NaNs
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    full = tl.minimum(t1, tl.maximum(seq_len // BLOCK_N, t0))  # tiles [t0, full) end within the sequence
    k_sc, v_sc = _tile_scales(t0, bt_row, seq_len, kvh, ks_ptr, vs_ptr, stride_sb, stride_ss, stride_sh, offs_n,
                              PAGE, BLOCK_N, KV_FP8, SCALE_CONTIG)  # fmt: skip
    if SWAP_AB:
        q_t = tl.trans(q)
        acc_t = tl.zeros([HEAD_DIM, G_PAD], dtype=tl.float32)
        for t in range(t0, full):
            k_next, v_next = _tile_scales(t + 1, bt_row, seq_len, kvh, ks_ptr, vs_ptr, stride_sb, stride_ss,
                                          stride_sh, offs_n, PAGE, BLOCK_N, KV_FP8, SCALE_CONTIG)  # fmt: skip
            m_i, l_i, acc_t = _decode_tile_t(
                q_t, m_i, l_i, acc_t, t, bt_row, seq_len, start, kvh, qk_scale, k_sc, v_sc, k_ptr, v_ptr,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd, offs_n, offs_d,
                PAGE, BLOCK_N, KV_FP8, V_TRANS, DOT_PREC, False, V_PAGES,
            )  # fmt: skip
            k_sc, v_sc = k_next, v_next
        for t in range(full, t1):  # at most one: the tile holding the sequence's end
            m_i, l_i, acc_t = _decode_tile_t(
                q_t, m_i, l_i, acc_t, t, bt_row, seq_len, start, kvh, qk_scale, k_sc, v_sc, k_ptr, v_ptr,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd, offs_n, offs_d,
                PAGE, BLOCK_N, KV_FP8, V_TRANS, DOT_PREC, True,
            )  # fmt: skip
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
        for t in range(t0, full):
            k_next, v_next = _tile_scales(t + 1, bt_row, seq_len, kvh, ks_ptr, vs_ptr, stride_sb, stride_ss,
                                          stride_sh, offs_n, PAGE, BLOCK_N, KV_FP8, SCALE_CONTIG)  # fmt: skip
            m_i, l_i, acc = _decode_tile(
                q, m_i, l_i, acc, t, bt_row, seq_len, start, kvh, qk_scale, k_sc, v_sc, k_ptr, v_ptr,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd, offs_n, offs_d,
                PAGE, BLOCK_N, KV_FP8, V_TRANS, DOT_PREC, False,
            )  # fmt: skip
            k_sc, v_sc = k_next, v_next
        for t in range(full, t1):  # at most one: the tile holding the sequence's end
            m_i, l_i, acc = _decode_tile(
                q, m_i, l_i, acc, t, bt_row, seq_len, start, kvh, qk_scale, k_sc, v_sc, k_ptr, v_ptr,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd, offs_n, offs_d,
                PAGE, BLOCK_N, KV_FP8, V_TRANS, DOT_PREC, True,
            )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _find_chunk(pid, seq_lens_ptr, window, batch, split_target, min_chunk, BLOCK_N: tl.constexpr,
                USE_WINDOW: tl.constexpr, SCAN_N: tl.constexpr, WAVES: tl.constexpr):  # fmt: skip
    """Program ``pid``'s chunk of the balanced partition: (sequence b, its first program, its chunk count n, its
    length); n == 0 when there are more programs than chunks. Two passes over ``seq_lens``: the chunk size
    ``c = max(ceil(total live tiles / target), min_chunk)``, then the sequence whose run of chunks holds pid.

    ``target`` is ``split_target`` (``WAVES`` waves of resident programs) when the lengths are uneven, and one
    wave (``split_target // WAVES``) when no live sequence is longer than UNIFORM_MAX_OVER_MEAN x the mean:
    extra waves only even out unequal chunks, and equal lengths split into equal chunks already, so there
    they would only add partials to write and merge (W1-short and W3 ran 3% slower than one fixed split)."""
    offs = tl.arange(0, SCAN_N)
    total = 0
    longest = 0
    live = 0
    for i in range(0, batch, SCAN_N):
        lens = tl.load(seq_lens_ptr + i + offs, mask=i + offs < batch, other=0)
        lo_v, hi_v = _tile_range(lens, window, BLOCK_N, USE_WINDOW)
        total += tl.sum(hi_v - lo_v, 0)
        longest = tl.maximum(longest, tl.max(hi_v - lo_v, 0))
        live += tl.sum((lens > 0).to(tl.int32), 0)
    target = split_target
    if WAVES > 1:
        if longest * live <= UNIFORM_MAX_OVER_MEAN * total:
            target = tl.maximum(split_target // WAVES, 1)
    chunk = tl.maximum((total + target - 1) // target, min_chunk)
    # This program's sequence: the one whose run of chunks [cum - n_b, cum) contains pid.
    base = 0
    b = 0
    first = 0
    n = 0
    seq_len = 0
    for i in range(0, batch, SCAN_N):
        ok = i + offs < batch
        lens = tl.load(seq_lens_ptr + i + offs, mask=ok, other=0)
        lo_v, hi_v = _tile_range(lens, window, BLOCK_N, USE_WINDOW)
        n_v = tl.where(ok, tl.maximum((hi_v - lo_v + chunk - 1) // chunk, 1), 0)
        cum = tl.cumsum(n_v, 0) + base
        hit = ok & (cum > pid) & (cum - n_v <= pid)
        b += tl.sum(tl.where(hit, i + offs, 0), 0)
        first += tl.sum(tl.where(hit, cum - n_v, 0), 0)
        n += tl.sum(tl.where(hit, n_v, 0), 0)
        seq_len += tl.sum(tl.where(hit, lens, 0), 0)
        base += tl.sum(n_v, 0)
    return b, first, n, seq_len


@triton.jit
def _decode_plan_kernel(seq_lens_ptr, plan_ptr, seq_info_ptr, window, batch, split_target, min_chunk,
                        BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, SCAN_N: tl.constexpr,
                        WAVES: tl.constexpr):  # fmt: skip
    """The balanced partition of one step, once for every layer that shares its lengths, tile and window:
    ``plan[pid] = (b, first, n, seq_len)`` per program (``_find_chunk``), and the merge's ``seq_info[b] =
    (first, n)``. Without it every program of every layer's split kernel redoes the two passes."""
    pid = tl.program_id(0)
    b, first, n, seq_len = _find_chunk(pid, seq_lens_ptr, window, batch, split_target, min_chunk, BLOCK_N,
                                       USE_WINDOW, SCAN_N, WAVES)  # fmt: skip
    tl.store(plan_ptr + 4 * pid, b)
    tl.store(plan_ptr + 4 * pid + 1, first)
    tl.store(plan_ptr + 4 * pid + 2, n)
    tl.store(plan_ptr + 4 * pid + 3, seq_len)
    if (n > 0) & (pid == first):
        tl.store(seq_info_ptr + 2 * b, first)
        tl.store(seq_info_ptr + 2 * b + 1, n)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, seq_info_ptr,
    counter_ptr, plan_ptr, qk_scale, window, batch, split_target, min_chunk,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_sb, stride_ss, stride_sh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, FIXED_SPLITS: tl.constexpr, FIXED_MIN_CHUNK: tl.constexpr, FIXED_MIN_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr, V_TRANS: tl.constexpr, SCALE_CONTIG: tl.constexpr, DOT16: tl.constexpr,
    DOT_PREC: tl.constexpr, SCAN_N: tl.constexpr, FUSED_MERGE: tl.constexpr, SWAP_AB: tl.constexpr,
    PLANNED: tl.constexpr, WAVES: tl.constexpr, V_PAGES: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    if FIXED_SPLITS > 0:  # bench A/B and tests: every sequence in exactly FIXED_SPLITS chunks
        b = pid // FIXED_SPLITS
        n = FIXED_SPLITS + b * 0
        first = b * FIXED_SPLITS
        seq_len = tl.load(seq_lens_ptr + b)
        if FIXED_MIN_CHUNK > 0:  # a short sequence takes fewer chunks (none under FIXED_MIN_CHUNK tiles)
            lo0, hi0 = _tile_range(seq_len, window, BLOCK_N, USE_WINDOW)
            n = tl.minimum(n, tl.maximum((hi0 - lo0 + FIXED_MIN_CHUNK - 1) // FIXED_MIN_CHUNK, FIXED_MIN_SPLITS))
            if pid - first >= n:
                return
    else:
        if PLANNED:  # the step's partition, computed once (_decode_plan_kernel)
            b = tl.load(plan_ptr + 4 * pid)
            first = tl.load(plan_ptr + 4 * pid + 1)
            n = tl.load(plan_ptr + 4 * pid + 2)
            seq_len = tl.load(plan_ptr + 4 * pid + 3)
        else:
            b, first, n, seq_len = _find_chunk(pid, seq_lens_ptr, window, batch, split_target, min_chunk, BLOCK_N,
                                               USE_WINDOW, SCAN_N, WAVES)  # fmt: skip
        if n == 0:  # more programs than chunks this step
            return
    j = pid - first
    lo, hi = _tile_range(seq_len, window, BLOCK_N, USE_WINDOW)
    per = (hi - lo + n - 1) // n
    t0 = lo + j * per
    t1 = tl.minimum(t0 + per, hi)
    start = 0
    if USE_WINDOW:
        start = tl.maximum(seq_len - window, 0)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_ok = offs_g < GROUP
    q = tl.load(
        q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None], other=0.0
    )
    q = to_dot16(q, DOT16)  # fp8 K/V: the products run in fp16 (one conversion instruction per 2 values)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    m_i, l_i, acc = _chunk_attention(
        q, t0, t1, bt_row, seq_len, start, kvh, qk_scale, k_ptr, v_ptr, ks_ptr, vs_ptr,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd, stride_sb, stride_ss, stride_sh,
        offs_n, offs_d, G_PAD, HEAD_DIM, PAGE, BLOCK_N, KV_FP8, V_TRANS, SCALE_CONTIG, DOT_PREC, SWAP_AB, V_PAGES,
    )  # fmt: skip
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if n == 1:
        o_ptrs = out_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        row = pid.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads  # [programs, Hq] partials
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_ok[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_ok)
        if FUSED_MERGE:  # the last of the sequence's chunks (per kv head) merges them: no second kernel
            tl.debug_barrier()  # every thread's partials stored before the release below
            count = counter_ptr + b * tl.num_programs(1) + kvh
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == n - 1:
                tl.debug_barrier()
                tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")  # zero again for the next call
                _merge_chunks(part_o_ptr, part_lse_ptr, out_ptr, first, n, b, heads, g_ok, offs_d,
                              GROUP * tl.num_programs(1), stride_ot, stride_oh, HEAD_DIM, G_PAD)  # fmt: skip
    if not PLANNED:  # (a plan wrote it once for every layer)
        if (j == 0) & (kvh == 0):  # where the merge finds this sequence's chunks
            tl.store(seq_info_ptr + 2 * b, first)
            tl.store(seq_info_ptr + 2 * b + 1, n)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, seq_info_ptr, out_ptr, num_heads,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, S_BLOCK_N: tl.constexpr, ZERO_EMPTY: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """Sequence b's chunks merged into its output row for query head h. ``ZERO_EMPTY``: a sequence with no chunk
    (n == 0: the stream split gives an empty one none) gets zeros here; the chunked splits give every sequence one."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(seq_info_ptr + 2 * b + 1)
    if ZERO_EMPTY:
        if n == 0:
            zeros = tl.zeros([HEAD_DIM], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + b * stride_ot + h * stride_oh + tl.arange(0, HEAD_DIM), zeros)
            return
    if n <= 1:  # written directly by its only chunk
        return
    first = tl.load(seq_info_ptr + 2 * b)
    offs_s = tl.arange(0, S_BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m = float("-inf")
    den = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, n, S_BLOCK_N):
        s_ok = s0 + offs_s < n
        row = (first + s0 + offs_s).to(tl.int64) * num_heads + h
        lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights exp2(-inf) = 0
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse - m_ref)
        o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        den = den * alpha + tl.sum(w, 0)
        m = m_new
    res = acc / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; CPU (the Triton interpreter) gets a small stand-in."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_split_target(num_kv_heads: int, sms: int, waves: int | None = None) -> int:
    """Chunks per kv head to aim for: ``waves`` waves of PROGRAMS_PER_SM resident programs per SM.

    Several waves let the block scheduler even out chunks of unequal length (list scheduling ends
    within one chunk of the mean, and a chunk is at most 1/waves of a slot's mean share).
    """
    waves = DECODE_WAVES if waves is None else waves
    return max(1, waves * PROGRAMS_PER_SM * sms // max(1, num_kv_heads))


def resident_programs(kv_dtype: torch.dtype) -> int:
    """Decode programs one SM holds at once for this cache dtype (decode_config's tile and registers)."""
    return FP8_PROGRAMS_PER_SM if is_fp8(kv_dtype) else PROGRAMS_PER_SM


def choose_num_splits(batch: int, num_kv_heads: int, max_tiles: int, sms: int, per_sm: int | None = None,
                      waves: int = 1) -> int:
    """One fixed split count per batch size: chunks per sequence for ``waves`` waves of ``per_sm`` resident
    programs per SM (default PROGRAMS_PER_SM; ``resident_programs`` gives a cache's), at least one, never more
    than MAX_SPLITS or the tiles. ``waves=1`` is the previous rule (``--compare-legacy``); the even path takes
    EVEN_WAVES (even_num_splits)."""
    slots = (PROGRAMS_PER_SM if per_sm is None else per_sm) * sms * waves
    return max(1, min(slots // max(1, batch * num_kv_heads), MAX_SPLITS, max_tiles))


def even_min_chunk_tiles(kv_dtype: torch.dtype) -> int:
    """The even split's smallest chunk in key tiles for this cache dtype (FP8_EVEN_MIN_CHUNK_TILES for fp8)."""
    return FP8_EVEN_MIN_CHUNK_TILES if is_fp8(kv_dtype) else EVEN_MIN_CHUNK_TILES


def even_num_splits(batch: int, num_kv_heads: int, max_tiles: int, sms: int, per_sm: int,
                    min_chunk_tiles: int | None = None) -> tuple[int, int]:
    """(num_splits, fixed_min_splits) of the even path: EVEN_WAVES waves' count capped at EVEN_MAX_SPLITS but never
    under one wave's, and one wave's count as the floor of a short sequence's chunks, which are at least
    ``min_chunk_tiles`` (default EVEN_MIN_CHUNK_TILES) above that floor."""
    one_wave = choose_num_splits(batch, num_kv_heads, max_tiles, sms, per_sm)
    waves = choose_num_splits(batch, num_kv_heads, max_tiles, sms, per_sm, EVEN_WAVES)
    # no more chunks than the longest context the graph holds (max_tiles) cuts into min_chunk_tiles-tile ones:
    # beyond that every extra program returns at once, and a short max_model_len stays on one wave's (legacy) count
    min_chunk_tiles = EVEN_MIN_CHUNK_TILES if min_chunk_tiles is None else min_chunk_tiles
    longest = max_tiles // max(1, min_chunk_tiles)
    return max(one_wave, min(waves, EVEN_MAX_SPLITS, longest)), one_wave


def decode_plan(plans: dict, seq_lens: torch.Tensor, block_n: int, window: int, split_target: int,
                min_chunk: int, waves: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(plan [programs, 4] int32, seq_info [B, 2] int32) of the balanced partition over ``seq_lens``, from
    ``plans`` if this step already made it for the same tile, window and target, else made now by
    ``_decode_plan_kernel`` (one launch; inside a CUDA graph it is captured, so every replay re-plans)."""
    key = (seq_lens.data_ptr(), seq_lens.shape[0], block_n, window, split_target, min_chunk, waves)
    got = plans.get(key)
    if got is None:
        batch = seq_lens.shape[0]
        programs = batch + split_target
        plan = torch.empty((programs, 4), dtype=torch.int32, device=seq_lens.device)
        seq_info = torch.empty((batch, 2), dtype=torch.int32, device=seq_lens.device)
        _decode_plan_kernel[(programs,)](
            seq_lens, plan, seq_info, window, batch, split_target, min_chunk,
            BLOCK_N=block_n, USE_WINDOW=window > 0, SCAN_N=SCAN, WAVES=waves, num_warps=4,
        )  # fmt: skip
        got = plans[key] = (plan, seq_info)
    return got


def decode_config(page: int, head_dim: int, kv_dtype: torch.dtype) -> tuple[int, int, int, int | None]:
    """(BLOCK_N, num_warps, num_stages, maxnreg or None). bf16: a key tile of about 16 KiB per operand, 64
    tokens at D = 128 (the H200 sweep's best), never less than a page. fp8 (swapped products): 64 tokens, two
    warps, three stages, registers capped at 168 (six programs per SM by registers and shared memory, 3 x 16
    KiB each): 0.234 ms at W2's B=256 shape against 0.257 for the previous (128, 4, 2, 168) and bf16's 0.307
    (bench/results/h200_2026-12-03_kernels_fp8_sweep_c6fd372.jsonl). kernels_bench --sweep-fp8 re-times."""
    tokens = 64 if head_dim <= 128 else 32
    if is_fp8(kv_dtype):
        return max(page, tokens, 16), 2, 3, FP8_DECODE_MAXNREG
    return max(page, tokens, 16), 4, 2, None


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor | KVPair,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    kv_scales: torch.Tensor | None = None,
    split_target: int | None = None,
    min_chunk: int = MIN_CHUNK_TILES,
    fused_merge: bool | None = None,
    swap_ab: bool | None = None,
    plans: dict | None = None,
    waves: int | None = None,
    v_pages: bool | None = None,
    even_lengths: bool | int = False,
    fixed_min_chunk: int | None = None,
    fixed_min_splits: int = 1,
    stream: bool | None = None,
    stream_waves: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence (q: [B, Hq, D]) over its ``seq_lens[i]`` cached tokens.

    ``kv_cache``: [2, num_blocks, block_size, Hkv, D], or an fp8 ``KVPair`` of value views (V
    token-contiguous) with its ``kv_scales``. The new token's K/V must already be in the cache. A
    sequence with ``seq_len == 0`` (CUDA-graph padding) gets zeros. ``num_splits`` forces every sequence
    into that many chunks (the old scheme; A/B and tests); ``split_target``/``min_chunk`` tune the
    balanced partition. ``fused_merge``: the last chunk of a split sequence merges the partials (one
    atomic counter per sequence and kv head) instead of a second kernel (opt-in until timed on the
    H200: bench/kernels_bench.py --compare-legacy). ``swap_ab``: the products with the key tile as the
    tensor cores' M side (``_decode_tile_t``); None = ``SWAP_AB`` for the cache's dtype (bench/kernels_bench.py
    --swap-ab times both). ``plans``: a dict owned by one step's metadata (``AttentionMetadata.decode_plans``):
    the balanced partition is computed by one small kernel on the first call of the step and kept there for
    every later layer with the same tile and window (None: each call's programs compute it themselves).
    ``waves``: how many waves of programs ``split_target`` holds (default: DECODE_WAVES with the default
    target, 1 with an explicit one); with more than one, even lengths (longest <= 2 x mean) are cut for one
    wave only (``_find_chunk``). ``even_lengths``: the caller found this step's lengths even (longest <= 2 x
    mean); with ``num_splits`` None and EVEN_FIXED_SPLIT on, the step takes ``choose_num_splits``'s fixed count
    for its batch size (``even_num_splits``) instead of the balanced partition; 2 says they are uniform too
    (the longest within 1/8 of the shortest), which with UNIFORM_ONE_WAVE takes one wave's count and no minimum
    chunk (otherwise as 1). ``stream``: the stream split (``paged_decode_stream``; None = ``STREAM_K``, for an fp8
    cache ``STREAM_K_FP8``) for a call without ``num_splits``, ``stream_waves`` waves of programs (None = its
    STREAM_WAVES), runs of at least ``min_chunk`` tiles. ``fixed_min_chunk``: with a fixed split, a sequence of
    t key tiles takes min(num_splits, max(fixed_min_splits, ceil(t / fixed_min_chunk)))
    chunks (None: EVEN_MIN_CHUNK_TILES and one wave's count on the even path, else 0 = exactly ``num_splits``).
    Returns ``out`` ([B, Hq, D], q's dtype).
    """
    check_paged_inputs(q, kv_cache, block_tables, kv_scales)
    window = check_window(sliding_window)
    batch, hq, d = q.shape
    page, hkv, _ = kv_shape(kv_cache)
    if seq_lens.shape != (batch,) or block_tables.shape[0] != batch:
        raise ValueError(
            f"decode needs one query per sequence: q has {batch} rows, seq_lens {tuple(seq_lens.shape)}, "
            f"block_tables {tuple(block_tables.shape)}"
        )
    if out is None:
        out = torch.empty((batch, hq, d), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1, f"out {tuple(out.shape)} must match q {tuple(q.shape)}"
    if batch == 0:
        return out
    if num_splits is not None and not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024]; got {num_splits}")
    if split_target is None:
        split_target = choose_split_target(hkv, num_sms(q.device))
        waves = DECODE_WAVES if waves is None else waves
    waves = 1 if waves is None else waves  # an explicit split_target is taken as it is, unless waves says
    if waves < 1:
        raise ValueError(f"waves must be >= 1; got {waves}")
    if split_target < 1 or min_chunk < 1:
        raise ValueError(f"split_target and min_chunk must be >= 1; got {split_target}, {min_chunk}")
    group = hq // hkv
    ptrs, strides, consts = kv_args(kv_cache, kv_scales, q)
    if swap_ab is None:
        swap_ab = SWAP_AB["fp8" if consts["KV_FP8"] else "16bit"]
    if v_pages is None:
        v_pages = V_PAGES
    v_pages = bool(v_pages and swap_ab and consts["V_TRANS"])
    g_pad = max(8 if swap_ab else 16, triton.next_power_of_2(group))  # a dot's N may be 8, its M 16 at least
    config = decode_config(page, d, ptrs[0].dtype)
    block_n, warps, stages, *maxnreg = config
    if stream is None:
        stream = STREAM_K_FP8 if consts["KV_FP8"] else STREAM_K
    if stream and num_splits is None:
        from rollout.kernels import paged_decode_stream as ps

        per_sm = FP8_PROGRAMS_PER_SM if consts["KV_FP8"] else STREAM_PROGRAMS_PER_SM
        programs = ps.stream_programs(hkv, num_sms(q.device), per_sm, stream_waves)
        if not consts["KV_FP8"]:
            config = (max(STREAM_BLOCK_N, page) if STREAM_BLOCK_N else block_n, STREAM_WARPS or warps, stages,
                      STREAM_MAXNREG or (maxnreg[0] if maxnreg else None))
        return ps.decode_stream(
            q, ptrs, strides, consts, block_tables, seq_lens, out, scale * LOG2E, window, programs, min_chunk, plans,
            config, swap_ab, v_pages, dot_precision(q), g_pad, _decode_reduce_kernel, S_BLOCK,
        )  # fmt: skip
    if even_lengths and EVEN_FIXED_SPLIT and num_splits is None and batch * hkv >= EVEN_MIN_ROWS:
        max_tiles = triton.cdiv(block_tables.shape[1] * page, block_n)
        if even_lengths == 2 and UNIFORM_ONE_WAVE:  # uniform: one wave's equal chunks, no minimum
            num_splits = choose_num_splits(batch, hkv, max_tiles, num_sms(q.device), resident_programs(ptrs[0].dtype))
        else:
            fixed_min_chunk = even_min_chunk_tiles(ptrs[0].dtype) if fixed_min_chunk is None else fixed_min_chunk
            num_splits, fixed_min_splits = even_num_splits(batch, hkv, max_tiles, num_sms(q.device),
                                                           resident_programs(ptrs[0].dtype), fixed_min_chunk)
    fixed_min_chunk = fixed_min_chunk or 0
    if fixed_min_chunk < 0 or fixed_min_splits < 1:
        raise ValueError(f"fixed_min_chunk must be >= 0 and fixed_min_splits >= 1; got {fixed_min_chunk}, "
                         f"{fixed_min_splits}")
    pdl = pdl_launch(q.device)
    launch = dict(num_warps=warps, num_stages=stages, **pdl)
    if maxnreg and maxnreg[0]:
        launch["maxnreg"] = maxnreg[0]
    programs = batch * num_splits if num_splits else batch + split_target
    part_o = torch.empty((programs, hq, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((programs, hq), dtype=torch.float32, device=q.device)
    planned = plans is not None and not num_splits
    if planned:
        plan, seq_info = decode_plan(plans, seq_lens, block_n, window, split_target, min_chunk, waves)
    else:
        plan, seq_info = seq_lens, torch.empty((batch, 2), dtype=torch.int32, device=q.device)
    if fused_merge is None:
        fused_merge = FUSED_MERGE
    if fused_merge and plans is not None:  # one zeroed set per step: each layer's last chunks leave them at zero
        counters = plans.get(("counters", batch, hkv))
        if counters is None:
            counters = plans[("counters", batch, hkv)] = torch.zeros((batch, hkv), dtype=torch.int32, device=q.device)
    elif fused_merge:
        counters = torch.zeros((batch, hkv), dtype=torch.int32, device=q.device)
    else:  # unread without the fused merge: no fill kernel per layer
        counters = torch.empty((1,), dtype=torch.int32, device=q.device)
    _decode_split_kernel[(programs, hkv)](
        q, *ptrs, block_tables, seq_lens, out, part_o, part_lse, seq_info, counters, plan,
        scale * LOG2E, window, batch, split_target, min_chunk,
        q.stride(0), q.stride(1),
        *strides,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, G_PAD=g_pad, HEAD_DIM=d, PAGE=page,
        BLOCK_N=block_n, FIXED_SPLITS=num_splits or 0, FIXED_MIN_CHUNK=fixed_min_chunk if num_splits else 0,
        FIXED_MIN_SPLITS=fixed_min_splits if num_splits and fixed_min_chunk else 1,
        USE_WINDOW=window > 0, **consts,
        DOT_PREC=dot_precision(q), SCAN_N=SCAN, FUSED_MERGE=fused_merge, SWAP_AB=swap_ab, PLANNED=planned,
        WAVES=waves, V_PAGES=v_pages, **launch,
    )  # fmt: skip
    if num_splits != 1 and not fused_merge:
        _decode_reduce_kernel[(batch, hq)](
            part_o, part_lse, seq_info, out, hq, out.stride(0), out.stride(1),
            HEAD_DIM=d, S_BLOCK_N=S_BLOCK, num_warps=4, **pdl,
        )  # fmt: skip
    return out
