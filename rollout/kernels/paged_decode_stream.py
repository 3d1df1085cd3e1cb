"""The stream split of paged decode attention ("stream-K" for decode, as in LeanAttention): one wave of
programs, each streaming an equal run of key tiles that may cross sequences.

The chunked splits (``paged_decode.py``) cut each sequence into chunks and let the block scheduler deal the
chunks out over several waves. Two costs remain there that the byte floor does not pay, and fp8 KV pays them
most (its tiles take half the time to copy, so a program's fixed costs weigh twice as much):

* every chunk is a program that starts cold: its plan, sequence length, query and first block ids are
  dependent loads before the first K/V copy is in flight, and its copy pipeline fills and drains once;
* the last wave: chunk counts are whole numbers of waves only by chance, and the slots left idle at the end
  of a step idle the SM's share of the bandwidth.

Here the grid is ``programs`` per kv head, about ``STREAM_WAVES`` waves of the SMs' resident programs. The
step's live key tiles, the sequences' tiles laid end to end, are cut into ``programs`` equal runs
(at least ``min_chunk`` tiles each, the chunked splits' MIN_CHUNK_TILES by default; programs past
the last run return at once); a program walks its run sequence by sequence: for each sequence it
touches, one pipelined loop over that sequence's tiles in the run (``_chunk_attention``, shared with the
chunked splits), then either the output (the run held the whole sequence) or an fp32 (out, log-sum-exp)
partial. A sequence's partials come from consecutive programs, so the partial of (program p, sequence b)
lives at row ``p + b`` (each step along the runs moves p or b by one): ``programs + batch`` rows. The
chunked splits' reduce kernel merges them; it writes zeros for a sequence with no tiles (seq_len 0: graph
padding), which no run touches.

The grid and buffers depend only on the batch size, so a CUDA graph per batch size replays for any lengths.
The plan (each program's first sequence and run, each sequence's partial rows) is one small kernel per step,
kept in the step's ``plans`` dict for every layer with the same tile and window.

On for fp8 caches (``paged_decode.STREAM_K_FP8``), off for 16-bit ones (``STREAM_K``). On an H100 the kernel is
faster than the engine's rules for fp8 at every W2 shape timed (1.01-1.07x), and W2 with fp8 KV ran 1.433x bf16
with it; for bf16 a wave of 6 programs an SM (``STREAM_PROGRAMS_PER_SM``) beat the rules by 0.8-2% in the kernel
bench, untimed in the engine. paged_decode.py has the numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.paged_common import to_dot16
from rollout.kernels.paged_decode import _chunk_attention, _tile_range
from rollout.kernels.pdl import pdl_enter, pdl_launch

# Waves of resident programs the stream split launches per step (1: every program resident at once, each run
# the step's exact share; more: shorter runs the block scheduler can even out when programs run at unequal
# speeds).
STREAM_WAVES = 1
# Sequences a program's run may touch, unrolled in the kernel (0: any number, a loop over them). The loop costs
# registers: the bf16 kernel takes 153 a thread with it (3 programs an SM) and 115-117 with 3-8 segments unrolled
# (4 an SM; bench/kernel_sass.py --kernel stream --stream-segs with Triton 3.6); fp8's stays at its cap (168) but
# stops reloading 13 spilled values in its loops. To keep every run within SEGS sequences the plan pads each
# sequence's share of the run space to at least ``vmin`` tiles (work-free tiles: a run over them does nothing
# there), the least that bounds every run (_stream_plan_kernel; bench/stream_balance.py shows what the padding
# costs in balance: SEGS 8, not 4); a batch too large for that (programs x (SEGS - 2) <= batch) takes the loop.
STREAM_SEGS = 0
SCAN = 256  # sequences per step of the plan's prefix sums


def stream_segs(segs: int, programs: int, batch: int) -> int:
    """The unrolled segment count for this launch: ``segs`` where it can bound every run (0 or >= 3; a run of R
    tiles over shares of at least m touches at most 2 + (R - 2) / m sequences), else 0 (the loop)."""
    if segs != 0 and segs < 3:
        raise ValueError(f"STREAM_SEGS must be 0 (a loop over a run's sequences) or >= 3; got {segs}")
    return segs if segs and programs * (segs - 2) > batch else 0


@triton.jit
def _stream_plan_kernel(seq_lens_ptr, plan_ptr, seq_info_ptr, window, batch, programs, min_chunk,
                        BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, SCAN_N: tl.constexpr,
                        SEGS: tl.constexpr):  # fmt: skip
    """One step's stream split. Program pid < ``programs``: ``plan[pid] = (first sequence, run space before it,
    run start, run end, vmin)`` (empty run: start == end). The run space lays the sequences end to end, each
    taking max(its live tiles, vmin) (vmin 0 without SEGS: the live tiles alone). Program pid < ``batch``:
    ``seq_info[pid] = (first partial row, partial count)`` (count 0: no tiles; 1: written directly)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, SCAN_N)
    total = 0
    for i in range(0, batch, SCAN_N):
        lens = tl.load(seq_lens_ptr + i + offs, mask=i + offs < batch, other=0)
        lo_v, hi_v = _tile_range(lens, window, BLOCK_N, USE_WINDOW)
        total += tl.sum(hi_v - lo_v, 0)
    vmin = total * 0
    if SEGS > 0:  # shares of at least vmin bound a run of max(ceil(V / programs), min_chunk) to SEGS sequences
        room = programs * (SEGS - 2) - batch  # > 0: the host checked (stream_segs)
        vmin = tl.maximum(tl.maximum((total - programs + room - 1) // room, (min_chunk + SEGS - 5) // (SEGS - 2)), 1)
        total = total * 0
        for i in range(0, batch, SCAN_N):
            lens = tl.load(seq_lens_ptr + i + offs, mask=i + offs < batch, other=0)
            lo_v, hi_v = _tile_range(lens, window, BLOCK_N, USE_WINDOW)
            total += tl.sum(tl.where(i + offs < batch, tl.maximum(hi_v - lo_v, vmin), 0), 0)
    chunk = tl.maximum((total + programs - 1) // programs, min_chunk)
    g0 = tl.minimum(pid * chunk, total)
    g1 = tl.minimum(g0 + chunk, total)
    base = 0
    b0 = 0
    before = 0
    seq_before = 0
    seq_tiles = 0
    for i in range(0, batch, SCAN_N):
        ok = i + offs < batch
        lens = tl.load(seq_lens_ptr + i + offs, mask=ok, other=0)
        lo_v, hi_v = _tile_range(lens, window, BLOCK_N, USE_WINDOW)
        nt = tl.where(ok, hi_v - lo_v, 0)
        share = tl.where(ok, tl.maximum(nt, vmin), 0)  # its part of the run space
        cum = tl.cumsum(share, 0) + base  # run space up to and including each sequence
        excl = cum - share
        hit = (cum > g0) & (excl <= g0)  # the sequence holding g0 (none with an empty share: cum == excl)
        b0 += tl.sum(tl.where(hit, i + offs, 0), 0)
        before += tl.sum(tl.where(hit, excl, 0), 0)
        mine = (i + offs) == pid
        seq_before += tl.sum(tl.where(mine, excl, 0), 0)
        seq_tiles += tl.sum(tl.where(mine, nt, 0), 0)
        base += tl.sum(share, 0)
    if pid < programs:
        tl.store(plan_ptr + 5 * pid, b0)
        tl.store(plan_ptr + 5 * pid + 1, before)
        tl.store(plan_ptr + 5 * pid + 2, g0)
        tl.store(plan_ptr + 5 * pid + 3, g1)
        tl.store(plan_ptr + 5 * pid + 4, vmin)
    if pid < batch:
        p_first = seq_before // chunk
        n = tl.where(seq_tiles > 0, (seq_before + seq_tiles - 1) // chunk - p_first + 1, 0)
        tl.store(seq_info_ptr + 2 * pid, p_first + pid)
        tl.store(seq_info_ptr + 2 * pid + 1, n)


@triton.jit
def _stream_segment(
    g, g1, base, b, vmin, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, window, pid, kvh, heads, g_ok, offs_n, offs_d,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_sb, stride_ss, stride_sh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, KV_FP8: tl.constexpr, V_TRANS: tl.constexpr, SCALE_CONTIG: tl.constexpr,
    DOT16: tl.constexpr, DOT_PREC: tl.constexpr, SWAP_AB: tl.constexpr, V_PAGES: tl.constexpr,
):  # fmt: skip
    """Sequence ``b``'s part of the run [g, g1) (its share of the run space starts at ``base``): the tiles of it
    the run holds through one pipelined loop, then its output (the run held all of it) or its partial at row
    pid + b. Returns (g, base, b) at the next sequence."""
    seq_len = tl.load(seq_lens_ptr + b)
    lo, hi = _tile_range(seq_len, window, BLOCK_N, USE_WINDOW)
    share_end = base + tl.maximum(hi - lo, vmin)
    t0 = lo + (g - base)
    t1 = lo + (tl.minimum(g1, base + (hi - lo)) - base)  # the run's tiles past the live ones hold no work
    if t1 > t0:
        start = 0
        if USE_WINDOW:
            start = tl.maximum(seq_len - window, 0)
        q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None],
                    other=0.0)  # fmt: skip
        q = to_dot16(q, DOT16)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        m_i, l_i, acc = _chunk_attention(
            q, t0, t1, bt_row, seq_len, start, kvh, qk_scale, k_ptr, v_ptr, ks_ptr, vs_ptr,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd, stride_sb, stride_ss,
            stride_sh, offs_n, offs_d, G_PAD, HEAD_DIM, PAGE, BLOCK_N, KV_FP8, V_TRANS, SCALE_CONTIG, DOT_PREC,
            SWAP_AB, V_PAGES,
        )  # fmt: skip
        has = l_i > 0.0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        if (t0 == lo) & (t1 == hi):  # the whole sequence in this run: its output, no partial
            o_ptrs = out_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
        else:
            row = (pid + b).to(tl.int64) * (GROUP * tl.num_programs(1)) + heads
            tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_ok[:, None])
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + row, lse, mask=g_ok)
    return tl.minimum(g1, share_end), share_end, b + 1


@triton.jit
def _decode_stream_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, plan_ptr,
    qk_scale, window, batch,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_sb, stride_ss, stride_sh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, KV_FP8: tl.constexpr, V_TRANS: tl.constexpr, SCALE_CONTIG: tl.constexpr,
    DOT16: tl.constexpr, DOT_PREC: tl.constexpr, SWAP_AB: tl.constexpr, V_PAGES: tl.constexpr, SEGS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(plan_ptr + 5 * pid)
    base = tl.load(plan_ptr + 5 * pid + 1)  # run space before sequence b's share
    g = tl.load(plan_ptr + 5 * pid + 2)
    g1 = tl.load(plan_ptr + 5 * pid + 3)
    vmin = tl.load(plan_ptr + 5 * pid + 4)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_ok = offs_g < GROUP
    if SEGS == 0:  # any number of sequences: a loop over them
        while (g < g1) & (b < batch):
            g, base, b = _stream_segment(
                g, g1, base, b, vmin, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr,
                part_lse_ptr, qk_scale, window, pid, kvh, heads, g_ok, offs_n, offs_d,
                stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd,
                stride_sb, stride_ss, stride_sh, stride_bt, stride_ot, stride_oh,
                GROUP, G_PAD, HEAD_DIM, PAGE, BLOCK_N, USE_WINDOW, KV_FP8, V_TRANS, SCALE_CONTIG, DOT16, DOT_PREC,
                SWAP_AB, V_PAGES,
            )  # fmt: skip
    else:  # at most SEGS (the plan's vmin bounds every run), unrolled: no state carried around a loop
        for _ in tl.static_range(SEGS):
            if (g < g1) & (b < batch):
                g, base, b = _stream_segment(
                    g, g1, base, b, vmin, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, out_ptr,
                    part_o_ptr, part_lse_ptr, qk_scale, window, pid, kvh, heads, g_ok, offs_n, offs_d,
                    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    stride_vd, stride_sb, stride_ss, stride_sh, stride_bt, stride_ot, stride_oh,
                    GROUP, G_PAD, HEAD_DIM, PAGE, BLOCK_N, USE_WINDOW, KV_FP8, V_TRANS, SCALE_CONTIG, DOT16,
                    DOT_PREC, SWAP_AB, V_PAGES,
                )  # fmt: skip


def stream_programs(num_kv_heads: int, sms: int, per_sm: int, waves: int | None = None) -> int:
    """Programs per kv head: ``waves`` (default STREAM_WAVES) waves of ``per_sm`` resident programs per SM."""
    waves = STREAM_WAVES if waves is None else waves
    if waves < 1:
        raise ValueError(f"stream waves must be >= 1; got {waves}")
    return max(1, waves * per_sm * sms // max(1, num_kv_heads))


def stream_plan(plans: dict | None, seq_lens: torch.Tensor, block_n: int, window: int, programs: int,
                min_chunk: int, segs: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(plan [programs, 5] int32, seq_info [B, 2] int32) of the stream split over ``seq_lens`` (``segs``: every
    run within that many sequences, stream_segs's count), from ``plans`` if this step already made it for the same
    tile, window, program and segment count, else made now (one launch)."""
    key = ("stream", seq_lens.data_ptr(), seq_lens.shape[0], block_n, window, programs, min_chunk, segs)
    got = None if plans is None else plans.get(key)
    if got is None:
        batch = seq_lens.shape[0]
        plan = torch.empty((programs, 5), dtype=torch.int32, device=seq_lens.device)
        seq_info = torch.empty((batch, 2), dtype=torch.int32, device=seq_lens.device)
        _stream_plan_kernel[(max(programs, batch),)](
            seq_lens, plan, seq_info, window, batch, programs, min_chunk,
            BLOCK_N=block_n, USE_WINDOW=window > 0, SCAN_N=SCAN, SEGS=segs, num_warps=4,
        )  # fmt: skip
        got = (plan, seq_info)
        if plans is not None:
            plans[key] = got
    return got


def decode_stream(q: torch.Tensor, ptrs: tuple, strides: tuple, consts: dict, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, out: torch.Tensor, qk_scale: float, window: int, programs: int,
                  min_chunk: int, plans: dict | None, config: tuple, swap_ab: bool, v_pages: bool,
                  dot_prec: str, g_pad: int, reduce_kernel, s_block: int) -> torch.Tensor:
    """Launch the stream split (plan, split kernel, reduce) on arguments ``paged_decode_attention`` checked."""
    batch, hq, d = q.shape
    page, hkv = ptrs[0].shape[1], ptrs[0].shape[2]
    block_n, warps, stages, *maxnreg = config
    if min_chunk < 1:
        raise ValueError(f"min_chunk must be >= 1; got {min_chunk}")
    segs = stream_segs(STREAM_SEGS, programs, batch)
    plan, seq_info = stream_plan(plans, seq_lens, block_n, window, programs, min_chunk, segs)
    part_o = torch.empty((programs + batch, hq, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((programs + batch, hq), dtype=torch.float32, device=q.device)
    pdl = pdl_launch(q.device)
    launch = dict(num_warps=warps, num_stages=stages, **pdl)
    if maxnreg and maxnreg[0]:
        launch["maxnreg"] = maxnreg[0]
    _decode_stream_kernel[(programs, hkv)](
        q, *ptrs, block_tables, seq_lens, out, part_o, part_lse, plan, qk_scale, window, batch,
        q.stride(0), q.stride(1), *strides, block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hkv, G_PAD=g_pad, HEAD_DIM=d, PAGE=page, BLOCK_N=block_n, USE_WINDOW=window > 0, **consts,
        DOT_PREC=dot_prec, SWAP_AB=swap_ab, V_PAGES=v_pages, SEGS=segs, **launch,
    )  # fmt: skip
    reduce_kernel[(batch, hq)](
        part_o, part_lse, seq_info, out, hq, out.stride(0), out.stride(1),
        HEAD_DIM=d, S_BLOCK_N=s_block, ZERO_EMPTY=True, num_warps=4, **pdl,
    )  # fmt: skip
    return out
