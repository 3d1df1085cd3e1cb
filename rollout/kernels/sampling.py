"""Fused sampler: one Triton program per row reads the logits once (plus a pass or two with filters).

``rollout.layers.sampler.sample_torch`` is the specification; this is its GPU path, token-identical for
the same seeds (see sampling_math for why) with logprobs equal to ~1e-6. The torch version built a
dozen [N, V] int64 temporaries for the noise, two log-softmaxes and a full sort for top-p; here
nothing [N, V] is written at all.

Pass 1 streams the row once: the online max/log-sum-exp of the scaled logits s = x * (1/T) (and of x
for ``raw`` logprobs when T != 1), and the exponential race argmax(s - log E) with its hashed noise.
A block whose largest s is more than NOISE_MAX below the best key so far cannot win and skips the noise.

Top-k / top-p / min-p keep {s >= t} for a per-row threshold t (the reference's definition, ties kept
together), so the race winner over the kept set is found without knowing t: take the winner w over a
candidate set (first all tokens); if w is kept it wins (the kept set is a subset of the candidates and w
beats them all); if not, t > s_w, so the candidates become {s > s_w} and the pass that counted the
tokens above w (for top-k) and their probability (for top-p) also found the next winner. Usually one
extra pass, and none when w is the argmax. After 4 rejections (or one with 2k tokens above w: a flat
row under a small top-k) t itself is searched (a multisection over float values / keys, NT thresholds
a pass) and one more pass races the kept set; ``processed`` logprobs search t anyway, for the kept mass.

No host syncs and no data-dependent shapes: capturable in CUDA graphs.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from rollout.kernels.sampling_math import log32, log_exp_noise, ofloat, okey, row_hash


@triton.jit
def _penalize(x, hist_row, offs, mask, rep, pres, freq, PEN: tl.constexpr):
    """The penalties on float32 logits x, op for op as ``sampler.apply_penalties``."""
    if PEN:
        hv = tl.load(hist_row + offs, mask=mask, other=0)
        x = tl.where(hv > 0, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
        cnt = (hv >> 1).to(tl.float32)
        x = x - freq * cnt
        x = x - pres * (cnt > 0).to(tl.float32)
    return x


@triton.jit
def _load_one(row_ptr, i, inv, hist_row, rep, pres, freq, PEN: tl.constexpr):
    """(x, s) of one token: its raw logit and its penalised, scaled one."""
    x = tl.load(row_ptr + i).to(tl.float32)
    return x, _penalize(x, hist_row, i, i >= 0, rep, pres, freq, PEN) * inv


@triton.jit
def _load_s(row_ptr, offs, V, inv, sup_row, hist_row, rep, pres, freq, NSUP: tl.constexpr, PEN: tl.constexpr):
    """(x, s) of one block: raw logits and scaled ones with suppressed ids and lanes past V at -inf."""
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    s = _penalize(x, hist_row, offs, offs < V, rep, pres, freq, PEN) * inv
    for j in tl.static_range(NSUP):
        s = tl.where(offs == tl.load(sup_row + j), float("-inf"), s)
    return x, s


@triton.jit
def _race_key(s, offs, h, greedy, ALL_GREEDY: tl.constexpr):
    if ALL_GREEDY:
        key = s
    elif greedy:
        key = s
    else:
        key = s - log_exp_noise(h, offs)
    return key


@triton.jit
def _first_pass(row_ptr, lo, hi, V, inv, sup_row, hist_row, rep, pres, freq, h, greedy, need_raw,
                NSUP: tl.constexpr, PEN: tl.constexpr, ALL_GREEDY: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Over ids [lo, hi) (lo a multiple of BLOCK): online (max, sum exp) of s over unsuppressed tokens, of x when
    ``need_raw``, and the race winner with its key (-inf and id 0 when no key beats -inf)."""
    ar = tl.arange(0, BLOCK)
    m = -3.0e38
    z = 0.0
    m_raw = -3.0e38
    z_raw = 0.0
    best = float("-inf")
    best_i = 0
    for start in range(lo, hi, BLOCK):
        offs = start + ar
        x, s = _load_s(row_ptr, offs, V, inv, sup_row, hist_row, rep, pres, freq, NSUP, PEN)
        bmax = tl.max(s, 0)
        m_new = tl.maximum(m, bmax)
        z = z * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new), 0)
        m = m_new
        if need_raw:
            r_new = tl.maximum(m_raw, tl.max(x, 0))
            z_raw = z_raw * tl.exp(m_raw - r_new) + tl.sum(tl.exp(x - r_new), 0)
            m_raw = r_new
        if bmax + 17.0 >= best:  # 17 > NOISE_MAX: no key of this block can beat ``best`` otherwise
            kmax, ki = tl.max(_race_key(s, offs, h, greedy, ALL_GREEDY), 0, return_indices=True)
            if kmax > best:  # strictly: ties go to the lowest id, as torch.argmax
                best = kmax
                best_i = start + ki
    return m, z, m_raw, z_raw, best, best_i


@triton.jit
def _above(row_ptr, V, inv, sup_row, hist_row, rep, pres, freq, h, greedy, s_w, t_minp, m,
           NSUP: tl.constexpr, PEN: tl.constexpr, ALL_GREEDY: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Tokens with s > s_w: their count, their mass exp(s - m), and the race winner among those >= t_minp."""
    ar = tl.arange(0, BLOCK)
    cnt = 0
    mass = 0.0
    best = float("-inf")
    best_i = 0
    for start in range(0, V, BLOCK):
        offs = start + ar
        _, s = _load_s(row_ptr, offs, V, inv, sup_row, hist_row, rep, pres, freq, NSUP, PEN)
        bmax = tl.max(s, 0)
        if bmax > s_w:
            gt = s > s_w
            cnt += tl.sum(gt.to(tl.int32), 0)
            mass += tl.sum(tl.where(gt, tl.exp(s - m), 0.0), 0)
            if bmax + 17.0 >= best:
                key = tl.where(gt & (s >= t_minp), _race_key(s, offs, h, greedy, ALL_GREEDY), float("-inf"))
                kmax, ki = tl.max(key, 0, return_indices=True)
                if kmax > best:
                    best = kmax
                    best_i = start + ki
    return cnt, mass, best_i


@triton.jit
def _kp_threshold(row_ptr, V, inv, sup_row, hist_row, rep, pres, freq, lo0, hi, m, z, k, top_p,
                  NSUP: tl.constexpr, PEN: tl.constexpr, SBLOCK: tl.constexpr, NT: tl.constexpr):  # fmt: skip
    """Smallest row value v that top-k and top-p keep, given a value ``lo0`` they drop (or -inf) and a
    kept one ``hi``.

    Invariant: v in (lo, hi]. Each pass tests NT thresholds inside (a threshold t passes iff fewer
    than k tokens and less than top_p of the mass lie above t: monotone in t), spread evenly in value
    while the bracket is wide and finite, else evenly over float keys (which ends it in a bounded
    number of passes); the pass also finds the smallest and largest row value in the bracket, which
    tighten it further. Adjacent keys (one float left) end it. Start: top-p keeps every token above
    m + log(z (1 - top_p) / V) (the tokens below carry less than 1 - top_p), less a margin, and lo0."""
    ar = tl.arange(0, SBLOCK)
    jj = tl.arange(0, NT) + 1
    k_cap = tl.where(k > 0, k, 2147483647)  # off -> never binding (scalars, so no bool vector | scalar)
    p_cap = tl.where(top_p < 1.0, top_p, float("inf"))
    lo = tl.maximum(lo0, tl.where(top_p < 1.0, m + tl.log(z * tl.maximum(1.0 - top_p, 1e-30) / V) - 1.0, lo0))
    lo_k = okey(tl.minimum(lo, hi)).to(tl.int64)
    hi_k = okey(hi).to(tl.int64)
    it = 0
    while (hi_k - lo_k > 1) & (it < 40):
        lo_f = ofloat(lo_k.to(tl.int32))
        hi_f = ofloat(hi_k.to(tl.int32))
        if (hi_k - lo_k > 1048576) & (lo_f > -3.0e38):
            tv = lo_f + (hi_f - lo_f) * (jj.to(tl.float32) / (NT + 1))
        else:
            tv = ofloat((lo_k + ((hi_k - lo_k) * jj.to(tl.int64)) // (NT + 1)).to(tl.int32))
        tk = okey(tv).to(tl.int64)
        cnt = tl.zeros([NT], dtype=tl.int32)
        mass = tl.zeros([NT], dtype=tl.float32)
        vmin = float("inf")
        vmax = float("-inf")
        for start in range(0, V, SBLOCK):
            _, s = _load_s(row_ptr, start + ar, V, inv, sup_row, hist_row, rep, pres, freq, NSUP, PEN)
            inb = (s > lo_f) & (s <= hi_f)
            vmin = tl.minimum(vmin, tl.min(tl.where(inb, s, float("inf")), 0))
            vmax = tl.maximum(vmax, tl.max(tl.where(inb, s, float("-inf")), 0))
            gt = s[:, None] > tv[None, :]
            cnt += tl.sum(gt.to(tl.int32), 0)
            mass += tl.sum(tl.where(gt, tl.exp(s - m)[:, None], 0.0), 0)
        q = (cnt < k_cap) & (mass / z < p_cap)
        lo_k = tl.maximum(tl.max(tl.where(q, lo_k, tk), 0), okey(vmin).to(tl.int64) - 1)
        hi_k = tl.minimum(tl.min(tl.where(q, tk, hi_k), 0), okey(vmax).to(tl.int64))
        it += 1
    return ofloat(hi_k.to(tl.int32))


@triton.jit
def _race_from(row_ptr, V, inv, sup_row, hist_row, rep, pres, freq, h, greedy, t, m, do_race,
               NSUP: tl.constexpr, PEN: tl.constexpr, ALL_GREEDY: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The kept set {s >= t}: its mass sum exp(s - m) and (when ``do_race``) its race winner."""
    ar = tl.arange(0, BLOCK)
    z = 0.0
    best = float("-inf")
    best_i = 0
    for start in range(0, V, BLOCK):
        offs = start + ar
        _, s = _load_s(row_ptr, offs, V, inv, sup_row, hist_row, rep, pres, freq, NSUP, PEN)
        kept = s >= t
        z += tl.sum(tl.where(kept, tl.exp(s - m), 0.0), 0)
        if do_race & (tl.max(tl.where(kept, s, float("-inf")), 0) + 17.0 >= best):
            key = tl.where(kept, _race_key(s, offs, h, greedy, ALL_GREEDY), float("-inf"))
            kmax, ki = tl.max(key, 0, return_indices=True)
            if kmax > best:
                best = kmax
                best_i = start + ki
    return best_i, z


@triton.jit
def _filter(row_ptr, V, inv, sup_row, hist_row, rep, pres, freq, h, greedy, w, m, z, k, top_p, min_p, want_kept_mass,
            NSUP: tl.constexpr, PEN: tl.constexpr, ALL_GREEDY: tl.constexpr, BLOCK: tl.constexpr, SBLOCK: tl.constexpr,
            NT: tl.constexpr):  # fmt: skip
    """(token, sum of exp(s - m) over the kept set) for a row with top-k / top-p / min-p (see module doc).

    At most 4 rejection rounds, fewer when top-k rejected a winner with twice k tokens above it
    (a flat row and a small k: the chain would be long); then the threshold is searched and the race
    run once more on the kept set. ``processed`` logprobs search the threshold anyway (for its mass)."""
    t_minp = tl.where(min_p > 0.0, m + log32(tl.maximum(min_p, 1e-30)), float("-inf"))
    has_kp = (k > 0) | (top_p < 1.0)
    k_cap = tl.where(k > 0, k, 1 << 40)
    p_cap = tl.where(top_p < 1.0, top_p, float("inf"))
    _, s_w = _load_one(row_ptr, w, inv, hist_row, rep, pres, freq, PEN)
    any_filter = has_kp | (min_p > 0.0)
    go = any_filter
    ok = go == 0
    lo_kp = float("-inf")  # the largest value seen that top-k / top-p drop: their threshold is above it
    rounds = 0
    while go:
        cnt = 0
        mass = 0.0
        nxt = w
        if (s_w < m) & (has_kp | (s_w < t_minp)):
            cnt, mass, nxt = _above(row_ptr, V, inv, sup_row, hist_row, rep, pres, freq, h, greedy, s_w, t_minp,
                                    m, NSUP, PEN, ALL_GREEDY, BLOCK)
        kp_ok = (cnt < k_cap) & (mass / z < p_cap)
        ok = (s_w >= t_minp) & kp_ok
        lo_kp = tl.where(kp_ok, lo_kp, tl.maximum(lo_kp, s_w))
        rounds += 1
        go = (ok == 0) & (rounds < 4) & (cnt < 2 * k_cap)
        if go:
            w = nxt
            _, s_w = _load_one(row_ptr, w, inv, hist_row, rep, pres, freq, PEN)
    z_kept = z
    if (ok == 0) | (want_kept_mass & any_filter):
        t = t_minp
        if has_kp:
            hi = tl.where(ok, s_w, m)  # a kept value: the accepted winner, or the max
            t = tl.maximum(t, _kp_threshold(row_ptr, V, inv, sup_row, hist_row, rep, pres, freq, lo_kp, hi, m, z,
                                            k, top_p, NSUP, PEN, SBLOCK, NT))
        w2, z_kept = _race_from(row_ptr, V, inv, sup_row, hist_row, rep, pres, freq, h, greedy, t, m, ok == 0,
                                NSUP, PEN, ALL_GREEDY, BLOCK)
        w = tl.where(ok, w, w2)
    return w, z_kept


@triton.jit
def _row_setup(row, temp_ptr, seed_ptr, pos_ptr, mode_ptr, hist_ptr, hist_stride, hrow_ptr, rep_ptr, pres_ptr,
               freq_ptr, PEN: tl.constexpr):  # fmt: skip
    """A row's settings: (penalty history row, rep, pres, freq, 1/T, greedy, mode, need_raw, noise state)."""
    hist_row = hist_ptr
    rep = 1.0
    pres = 0.0
    freq = 0.0
    if PEN:
        hist_row = hist_ptr + tl.load(hrow_ptr + row) * hist_stride
        rep = tl.load(rep_ptr + row)
        pres = tl.load(pres_ptr + row)
        freq = tl.load(freq_ptr + row)
    temp = tl.load(temp_ptr + row)
    greedy = temp == 0.0
    inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.where(greedy, 1.0, temp))  # as torch's 1.0 / T
    mode = tl.load(mode_ptr + row)
    need_raw = (mode == 2) & (inv != 1.0)
    if PEN:
        need_raw = mode == 2  # raw logprobs are of the unpenalised logits
    h = row_hash(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
    return hist_row, rep, pres, freq, inv, greedy, mode, need_raw, h


@triton.jit
def _row_finish(row, row_ptr, V, inv, sup_row, hist_row, rep, pres, freq, h, greedy, mode, need_raw,
                m, z, m_raw, z_raw, w, topk_ptr, topp_ptr, minp_ptr, tok_ptr, lp_ptr,
                NSUP: tl.constexpr, PEN: tl.constexpr, FILTER: tl.constexpr, ALL_GREEDY: tl.constexpr,
                BLOCK: tl.constexpr, SBLOCK: tl.constexpr, NT: tl.constexpr):  # fmt: skip
    """From the first pass's statistics and winner: the filters (if any), the token and its logprob."""
    # policy logprobs normalise over every token, suppressed ones included (their s, deduplicated)
    m_all = m
    z_all = z
    for j in tl.static_range(NSUP):
        sid = tl.load(sup_row + j)
        fresh = (sid >= 0) & (sid < V)
        for j2 in tl.static_range(j):
            fresh = fresh & (tl.load(sup_row + j2) != sid)
        x_sup = tl.load(row_ptr + sid, mask=fresh, other=float("-inf")).to(tl.float32)
        s_sup = _penalize(x_sup, hist_row, sid, fresh, rep, pres, freq, PEN) * inv
        m_new = tl.maximum(m_all, s_sup)
        z_all = z_all * tl.exp(m_all - m_new) + tl.exp(s_sup - m_new)
        m_all = m_new
    z_proc = z
    if FILTER:
        w, z_proc = _filter(
            row_ptr, V, inv, sup_row, hist_row, rep, pres, freq, h, greedy, w, m, z, tl.load(topk_ptr + row),
            tl.load(topp_ptr + row), tl.load(minp_ptr + row), mode == 1, NSUP, PEN, ALL_GREEDY, BLOCK, SBLOCK, NT,
        )  # fmt: skip
    x_w, s_w = _load_one(row_ptr, w, inv, hist_row, rep, pres, freq, PEN)
    lp = s_w - (m_all + tl.log(z_all))
    if mode == 1:
        lp = s_w - (m + tl.log(z_proc))
    if mode == 2:
        if need_raw:
            lp = x_w - (m_raw + tl.log(z_raw))
    tl.store(tok_ptr + row, w.to(tl.int64))
    tl.store(lp_ptr + row, lp)


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, V,
    temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, mode_ptr, sup_ptr, sup_stride,
    tok_ptr, lp_ptr, hist_ptr, hist_stride, hrow_ptr, rep_ptr, pres_ptr, freq_ptr,
    NSUP: tl.constexpr, PEN: tl.constexpr, FILTER: tl.constexpr, ALL_GREEDY: tl.constexpr,
    BLOCK: tl.constexpr, SBLOCK: tl.constexpr, NT: tl.constexpr,
):  # fmt: skip
    """One program per row: the whole row's first pass, then the filters, token and logprob."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    sup_row = sup_ptr + row * sup_stride
    hist_row, rep, pres, freq, inv, greedy, mode, need_raw, h = _row_setup(
        row, temp_ptr, seed_ptr, pos_ptr, mode_ptr, hist_ptr, hist_stride, hrow_ptr, rep_ptr, pres_ptr, freq_ptr, PEN)
    m, z, m_raw, z_raw, _, w = _first_pass(row_ptr, 0, V, V, inv, sup_row, hist_row, rep, pres, freq, h, greedy,
                                           need_raw, NSUP, PEN, ALL_GREEDY, BLOCK)
    _row_finish(row, row_ptr, V, inv, sup_row, hist_row, rep, pres, freq, h, greedy, mode, need_raw,
                m, z, m_raw, z_raw, w, topk_ptr, topp_ptr, minp_ptr, tok_ptr, lp_ptr,
                NSUP, PEN, FILTER, ALL_GREEDY, BLOCK, SBLOCK, NT)  # fmt: skip


@triton.jit
def _sample_part_kernel(
    logits_ptr, stride_row, V, chunk,
    temp_ptr, seed_ptr, pos_ptr, mode_ptr, sup_ptr, sup_stride,
    stat_ptr, idx_ptr, hist_ptr, hist_stride, hrow_ptr, rep_ptr, pres_ptr, freq_ptr,
    NSUP: tl.constexpr, PEN: tl.constexpr, ALL_GREEDY: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (row, part): the first pass over ids [part * chunk, (part + 1) * chunk); its (m, z, m_raw, z_raw,
    race key) go to stat [N, S, 5], its winner to idx [N, S]."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    row_ptr = logits_ptr + row * stride_row
    sup_row = sup_ptr + row * sup_stride
    hist_row, rep, pres, freq, inv, greedy, mode, need_raw, h = _row_setup(
        row, temp_ptr, seed_ptr, pos_ptr, mode_ptr, hist_ptr, hist_stride, hrow_ptr, rep_ptr, pres_ptr, freq_ptr, PEN)
    lo = part * chunk
    hi = tl.minimum(lo + chunk, V)
    m, z, m_raw, z_raw, best, w = _first_pass(row_ptr, lo, hi, V, inv, sup_row, hist_row, rep, pres, freq, h,
                                              greedy, need_raw, NSUP, PEN, ALL_GREEDY, BLOCK)  # fmt: skip
    st = stat_ptr + (row * parts + part) * 5
    tl.store(st, m)
    tl.store(st + 1, z)
    tl.store(st + 2, m_raw)
    tl.store(st + 3, z_raw)
    tl.store(st + 4, best)
    tl.store(idx_ptr + row * parts + part, w)


@triton.jit
def _sample_merge_kernel(
    logits_ptr, stride_row, V, parts,
    temp_ptr, seed_ptr, pos_ptr, mode_ptr, sup_ptr, sup_stride,
    tok_ptr, lp_ptr, stat_ptr, idx_ptr, hist_ptr, hist_stride, hrow_ptr, rep_ptr, pres_ptr, freq_ptr,
    NSUP: tl.constexpr, PEN: tl.constexpr, ALL_GREEDY: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """One program per row: merges the parts' statistics (the race: the largest key, ties to the lowest part,
    whose own ties went to its lowest id) and finishes the row as ``_sample_kernel`` does without filters."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    sup_row = sup_ptr + row * sup_stride
    hist_row, rep, pres, freq, inv, greedy, mode, need_raw, h = _row_setup(
        row, temp_ptr, seed_ptr, pos_ptr, mode_ptr, hist_ptr, hist_stride, hrow_ptr, rep_ptr, pres_ptr, freq_ptr, PEN)
    j = tl.arange(0, SP)
    ok = j < parts
    st = stat_ptr + (row * parts + j) * 5
    mj = tl.load(st, mask=ok, other=-3.0e38)
    m = tl.max(mj, 0)
    z = tl.sum(tl.load(st + 1, mask=ok, other=0.0) * tl.exp(mj - m), 0)
    rj = tl.load(st + 2, mask=ok, other=-3.0e38)
    m_raw = tl.max(rj, 0)
    z_raw = tl.sum(tl.load(st + 3, mask=ok, other=0.0) * tl.exp(rj - m_raw), 0)
    _, jw = tl.max(tl.load(st + 4, mask=ok, other=float("-inf")), 0, return_indices=True,
                   return_indices_tie_break_left=True)
    w = tl.load(idx_ptr + row * parts + jw)
    _row_finish(row, row_ptr, V, inv, sup_row, hist_row, rep, pres, freq, h, greedy, mode, need_raw,
                m, z, m_raw, z_raw, w, temp_ptr, temp_ptr, temp_ptr, tok_ptr, lp_ptr,
                NSUP, PEN, False, ALL_GREEDY, 16, 16, 2)  # fmt: skip


def sample_parts(n: int, vocab: int, block: int, sms: int, programs_per_sm: int = 4) -> int:
    """Parts per row for the split first pass: enough programs for ``programs_per_sm`` per SM, at most one
    block of ids per part; 1 (the one-kernel path) when the rows alone fill the GPU."""
    return max(1, min(triton.cdiv(vocab, block), (programs_per_sm * sms) // max(n, 1)))


def fused_sample(
    logits: torch.Tensor,
    st: Any,
    block: int = 2048,
    search_block: int = 512,
    num_thresholds: int = 16,
    num_warps: int = 8,
    parts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] (float32, or the model's bf16 / fp16: converted in registers) -> (token ids [N] int64,
    logprobs [N] float32), as ``sample_torch``; ``st`` is a ``rollout.layers.sampler.SamplingTensors`` (not
    imported: that module imports this one).

    ``block``: logits per loop step of a row's program; ``search_block`` / ``num_thresholds``: the
    processed-logprob threshold search's step and thresholds per pass (bench/sampler_bench.py --sweep).
    ``parts``: programs per row of the first pass (None: ``sample_parts`` from the SM count; batches without
    filters only). One program per row leaves most SMs idle at decode batch sizes below a few per SM, and the
    race's noise (a hash and two logs per token) makes the pass compute-bound, so rows are split into parts
    whose statistics a second, tiny kernel merges (same tokens; the log-sum-exp summed in another order)."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a float [N, V] tensor; got {logits.dtype} {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return tokens, logprobs
    if parts is not None and parts < 1:
        raise ValueError(f"parts must be >= 1; got {parts}")
    sup = st.suppress_ids
    if sup is not None and sup.stride(-1) != 1:
        sup = sup.contiguous()
    pen = st.penalties
    if pen is None:
        pen_args = (st.seed, 0, st.seed, st.temperature, st.temperature, st.temperature)  # unread
    else:
        pen_args = (pen.hist, pen.hist.stride(0), pen.rows, pen.repetition, pen.presence, pen.frequency)
    sup_args = (sup if sup is not None else st.seed, sup.stride(0) if sup is not None else 0)
    consts = dict(NSUP=sup.shape[1] if sup is not None else 0, PEN=pen is not None, ALL_GREEDY=bool(st.all_greedy))
    if st.needs_filter:
        parts = 1  # the filters' passes need the whole row's statistics first
    elif parts is None:
        from rollout.kernels.paged_decode import num_sms

        parts = sample_parts(n, vocab, block, num_sms(logits.device))
    chunk = triton.cdiv(triton.cdiv(vocab, parts), block) * block  # whole blocks per part
    parts = triton.cdiv(vocab, chunk)
    if parts == 1:
        _sample_kernel[(n,)](
            logits, logits.stride(0), vocab,
            st.temperature, st.top_k, st.top_p, st.min_p, st.seed, st.position, st.mode, *sup_args,
            tokens, logprobs, *pen_args,
            **consts, FILTER=bool(st.needs_filter),
            BLOCK=block, SBLOCK=search_block, NT=num_thresholds, num_warps=num_warps, enable_fp_fusion=False,
        )  # fmt: skip
        return tokens, logprobs
    # SP (the merge's lanes) depends on the vocabulary alone: one compile per model, whatever the row count
    stats = torch.empty((n, parts, 5), dtype=torch.float32, device=logits.device)
    idx = torch.empty((n, parts), dtype=torch.int32, device=logits.device)
    row_args = (st.temperature, st.seed, st.position, st.mode, *sup_args)
    _sample_part_kernel[(n, parts)](
        logits, logits.stride(0), vocab, chunk, *row_args, stats, idx, *pen_args,
        **consts, BLOCK=block, num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip
    _sample_merge_kernel[(n,)](
        logits, logits.stride(0), vocab, parts, *row_args, tokens, logprobs, stats, idx, *pen_args,
        **consts, SP=triton.next_power_of_2(triton.cdiv(vocab, block)), num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip
    return tokens, logprobs
