"""Sampling when each tensor-parallel rank holds only a slice of the vocabulary's logits.

The exponential race needs no full row: every rank draws the same counter-hash noise one GPU would
(a pure function of seed, position and *global* token id), finds its slice's best candidate, and the
ranks exchange a few numbers per row (candidate key, global id, its logit, and a (max, sum-exp)
log-normaliser per distribution). The winner is the best key, ties to the lowest id as ``argmax``
would, and its logprobs come from the combined normalisers: the same tokens for the same seeds as
one GPU. Every rank ends with the same tokens (the next step's carry-over needs them everywhere).

Top-k / top-p / min-p need the sorted whole row, so those steps (a host flag) gather the full logits
and run the one-GPU sampler on them: exact, at the price of one [N, vocab] all-gather.
"""

from __future__ import annotations

import torch

from rollout.distributed.group import TPGroup
from rollout.layers.sampler import (
    MODE_PROCESSED,
    MODE_RAW,
    SamplingTensors,
    log32,
    sample,
    suppress_mask,
    uniform_noise,
)


def sample_vocab_parallel(
    logits: torch.Tensor, st: SamplingTensors, tp: TPGroup, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's logits [N, V / world] for ids ``vocab_start ..`` -> (tokens [N], logprobs [N]), as
    ``sample`` gives over the full row, on every rank."""
    if not tp.is_parallel:
        return sample(logits, st)
    x = logits.float()
    n, width = x.shape
    if st.needs_filter:
        return sample(tp.all_gather(x).permute(1, 0, 2).reshape(n, tp.world_size * width), st)
    greedy = st.temperature == 0
    inv_t = 1.0 / torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    scaled = x * inv_t[:, None]  # exactly as sample_torch scales, so keys and logprobs match bit for bit
    proc = scaled
    if st.suppress_ids is not None:
        proc = scaled.masked_fill(suppress_mask(st.suppress_ids - vocab_start, width), float("-inf"))
    key = proc
    if not st.all_greedy:
        noise = uniform_noise(st.seed, st.position, width, first_id=vocab_start)
        key = torch.where(greedy[:, None], proc, proc - log32(-log32(noise)))
    best, idx = key.max(-1)
    at = idx[:, None]
    norm_scaled = _max_sumexp(scaled)
    norm_raw = norm_scaled if st.all_greedy else _max_sumexp(x)  # greedy rows use T = 1
    norm_proc = norm_scaled if st.suppress_ids is None else _max_sumexp(proc)
    stats = torch.stack([
        best, (idx + vocab_start).to(torch.float32), x.gather(1, at)[:, 0], scaled.gather(1, at)[:, 0],
        *norm_raw, *norm_scaled, *norm_proc,
    ], dim=-1).double()
    g = tp.all_gather(stats)  # [world, N, 10]
    win = g[:, :, 0].argmax(0)[None, :, None]  # first max: the lowest rank, i.e. the lowest id
    _, token, x_tok, scaled_tok = g[:, :, :4].gather(0, win.expand(1, n, 4))[0].unbind(-1)
    raw_lp = x_tok - _combine(g[:, :, 4], g[:, :, 5])
    policy_lp = scaled_tok - _combine(g[:, :, 6], g[:, :, 7])
    proc_lp = scaled_tok - _combine(g[:, :, 8], g[:, :, 9]) if st.suppress_ids is not None else policy_lp
    lp = torch.where(st.mode == MODE_RAW, raw_lp, torch.where(st.mode == MODE_PROCESSED, proc_lp, policy_lp))
    return token.to(torch.int64), lp.float()


def _max_sumexp(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (max, sum exp(v - max)); a slice that is all -inf gives (-inf, 0)."""
    m = v.max(-1).values
    finite = torch.isfinite(m)
    s = torch.exp(v - torch.where(finite, m, torch.zeros_like(m))[:, None]).sum(-1)
    return m, torch.where(finite, s, torch.zeros_like(s))


def _combine(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[world, N] per-slice (max, sum-exp) -> [N] logsumexp of the whole row."""
    top = m.max(0).values
    scale = torch.where(torch.isfinite(m), torch.exp(m - top), torch.zeros_like(m))
    return top + torch.log((s * scale).sum(0))
