"""Sampling and logprobs, batch-invariant and free of host syncs.

Randomness comes from a counter-based hash of (seed, output position, vocab id), not from a
stateful generator: a seeded request draws the same tokens whatever else is in the batch, after
preemption, on CPU or GPU, and the whole thing can be captured in a CUDA graph. A token is drawn by
the exponential race argmax(p / E), E ~ Exp(1) (gpt-fast), equivalent to sampling from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
MODE_POLICY, MODE_PROCESSED, MODE_RAW = 0, 1, 2
MODES = {"policy": MODE_POLICY, "processed": MODE_PROCESSED, "raw": MODE_RAW}


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling settings on the logits' device. Greedy rows have temperature 0."""

    temperature: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] float32, 1 = off
    min_p: torch.Tensor  # [N] float32, 0 = off
    seed: torch.Tensor  # [N] int64
    position: torch.Tensor  # [N] int64, output index being sampled
    mode: torch.Tensor  # [N] int64: MODE_*
    suppress_ids: torch.Tensor | None = None  # [N, S] int64, -1 padded: ids not to sample (EOS before min_tokens)
    needs_filter: bool = True  # any row with top-k / top-p / min-p (host flag: skips the sort otherwise)
    all_greedy: bool = False  # host flag: skip drawing noise


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (constants < 2^31 so products stay inside int64).
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int, first_id: int = 0) -> torch.Tensor:
    """U(0, 1) per (row, vocab id), a pure function of (seed, position, id): [N, V] float32 for ids
    ``first_id ..`` (a vocabulary-parallel rank draws its slice's share of one-GPU noise)."""
    s = (seed ^ (seed >> 32)) & _M32
    h = _mix32(s ^ _mix32((position & _M32) + 0x3C6EF372))
    ids = torch.arange(first_id, first_id + vocab_size, device=seed.device, dtype=torch.int64)
    x = _mix32((h[:, None] + ids[None, :] * 0x1B873593) & _M32)
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def _filter(logp: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p exclude; logp are log-probabilities [N, V]."""
    sorted_lp, _ = logp.sort(dim=-1, descending=True)
    vocab = logp.shape[-1]
    # top-k: keep values >= the k-th largest
    k = torch.where(st.top_k > 0, st.top_k.clamp(max=vocab), torch.full_like(st.top_k, vocab))
    kth = sorted_lp.gather(1, (k - 1)[:, None])
    keep = logp >= kth
    # top-p: keep the smallest prefix whose mass reaches top_p (the token crossing it included)
    probs_sorted = sorted_lp.exp()
    mass_before = probs_sorted.cumsum(-1) - probs_sorted
    last = (mass_before < st.top_p[:, None]).sum(-1, keepdim=True).clamp(min=1)
    pth = sorted_lp.gather(1, last - 1)
    neg_inf = torch.full_like(pth, float("-inf"))
    keep &= logp >= torch.where(st.top_p[:, None] >= 1.0, neg_inf, pth)
    # min-p: keep tokens with p >= min_p * p_max
    mth = sorted_lp[:, :1] + torch.log(st.min_p[:, None].clamp(min=1e-30))
    keep &= logp >= torch.where(st.min_p[:, None] > 0, mth, neg_inf)
    return logp.masked_fill(~keep, float("-inf"))


def suppress_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, S] ids (-1 = none) -> [N, V] bool mask, without host syncs (-1 lands in a spare column)."""
    mask = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    idx = torch.where((ids >= 0) & (ids < vocab_size), ids, torch.full_like(ids, vocab_size))
    mask.scatter_(1, idx, True)
    return mask[:, :vocab_size]


def sample(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] (float32) -> (token ids [N] int64, logprobs [N] float32)."""
    logits = logits.float()
    greedy = st.temperature == 0
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    raw_lp = torch.log_softmax(logits, dim=-1)
    policy_lp = torch.log_softmax(logits / temp[:, None], dim=-1)  # T = 1 for greedy rows
    proc = policy_lp
    if st.suppress_ids is not None:
        proc = proc.masked_fill(suppress_mask(st.suppress_ids, logits.shape[-1]), float("-inf"))
    if st.needs_filter:
        proc = _filter(proc, st)
    if st.suppress_ids is not None or st.needs_filter:
        proc = torch.log_softmax(proc, dim=-1)  # renormalise what is left
    if st.all_greedy:
        tokens = proc.argmax(-1)
    else:
        noise = uniform_noise(st.seed, st.position, logits.shape[-1])
        race = proc - torch.log(-torch.log(noise))  # argmax(p / E) == argmax(log p - log E)
        tokens = torch.where(greedy, proc.argmax(-1), race.argmax(-1))
    idx = tokens[:, None]
    lp = torch.where(
        st.mode == MODE_RAW,
        raw_lp.gather(1, idx)[:, 0],
        torch.where(st.mode == MODE_PROCESSED, proc.gather(1, idx)[:, 0], policy_lp.gather(1, idx)[:, 0]),
    )
    return tokens, lp
