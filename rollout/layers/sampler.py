"""Sampling and logprobs, batch-invariant and free of host syncs.

Randomness comes from a counter-based hash of (seed, output position, vocab id), not from a
stateful generator: a seeded request draws the same tokens whatever else is in the batch, after
preemption, on CPU or GPU, and the whole thing can be captured in a CUDA graph. A token is drawn by
the exponential race argmax(p / E), E ~ Exp(1) (gpt-fast), equivalent to sampling from p.

This torch code is the CPU path and the oracle of the fused Triton kernel
(``rollout.kernels.sampling``), which ``sample`` uses for CUDA logits. The two agree token for token
because every step that decides a token is computed identically by both: the hash in 32-bit integer
arithmetic, the noise's logarithms by ``log32`` (only IEEE add/mul, no library ``log`` whose last bit
differs between torch, numpy and libdevice), the race key as ``s - log E`` on the scaled logits
``s = x * (1/T)`` (not on log-probabilities, whose normaliser no two reductions round alike), ties to
the lowest token id. Log-probabilities are computed freely (they agree to ~1e-6).

Filters (the kept set, ties included): with s the scaled logits and suppressed ids removed, a token of
value v is kept iff fewer than ``top_k`` tokens have s > v, the probability of the tokens with s > v is
below ``top_p``, and v >= max(s) + log(min_p). All three are thresholds on v, so equal values are kept
or dropped together (the sorted definition's "token that crosses top_p" brings its ties along).

Penalties (vLLM's semantics, applied to the logits x before temperature): a token seen in the prompt or
the output has x / r (x > 0) or x * r (x <= 0) for repetition penalty r, then x - f * count - p * (count > 0)
over output counts. ``policy`` and ``processed`` logprobs see the penalised logits, ``raw`` the model's own.
Counts live on the device (``Penalties.hist``, one int32 row per sequence: 2 * output count + in prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
MODE_POLICY, MODE_PROCESSED, MODE_RAW = 0, 1, 2
MODES = {"policy": MODE_POLICY, "processed": MODE_PROCESSED, "raw": MODE_RAW}
# Cephes' logf polynomial, each constant exactly a float32 (so torch and Triton round nothing differently).
_LOG_POLY = (0.07037683576345444, -0.11514610052108765, 0.11676998436450958, -0.12420140951871872,
             0.14249323308467865, -0.16668057441711426, 0.2000071406364441, -0.24999994039535522,
             0.3333333134651184)  # fmt: skip
_LOG_Q1, _LOG_Q2, _SQRT_HALF = -0.00021219444170128554, 0.693359375, 0.7071067690849304


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
    needs_filter: bool = True  # any row with top-k / top-p / min-p (host flag: skips the filter work otherwise)
    all_greedy: bool = False  # host flag: skip drawing noise
    penalties: Penalties | None = None  # None: no row of the batch has a penalty (host flag: skip them)
    num_top_logprobs: int = 0  # host int: also return each row's this many most likely tokens


@dataclass(slots=True)
class Penalties:
    """Per-row penalty settings and where each row's token history lives on the device."""

    hist: torch.Tensor  # [R, V] int32: 2 * (count in the output) + (1 if in the prompt)
    rows: torch.Tensor  # [N] int64: each sampling row's row of ``hist`` (a zero row for rows without penalties)
    repetition: torch.Tensor  # [N] float32, 1 = off
    presence: torch.Tensor  # [N] float32, 0 = off
    frequency: torch.Tensor  # [N] float32, 0 = off


def apply_penalties(x: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """Float32 logits [N, V] with the penalties applied, op for op as the fused kernel."""
    h = pen.hist[pen.rows]
    rep = pen.repetition[:, None]
    x = torch.where(h > 0, torch.where(x > 0, x / rep, x * rep), x)
    cnt = (h >> 1).to(torch.float32)
    x = x - pen.frequency[:, None] * cnt
    return x - pen.presence[:, None] * (cnt > 0).to(torch.float32)


def count_samples(pen: Penalties, tokens: torch.Tensor) -> None:
    """Add this step's samples to their rows' output counts, on the device (no host round trip)."""
    on = (pen.repetition != 1) | (pen.presence != 0) | (pen.frequency != 0)
    flat = pen.rows * pen.hist.shape[1] + tokens  # scatter_add: atomics, no sort, capturable in a CUDA graph
    pen.hist.view(-1).scatter_add_(0, flat, on.to(torch.int32) * 2)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (constants < 2^31 so products stay inside int64).
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int, first_id: int = 0) -> torch.Tensor:
    """U(0, 1) per (row, vocab id), a pure function of (seed, position, id): [N, V] float32 for ids
    ``first_id ..`` (a vocabulary-parallel rank draws its slice's share of one-GPU noise).

    23 hash bits + 0.5 fit a float32 exactly, so U is strictly inside (0, 1) (with 24 bits the top
    value rounded to 1.0, E = -log U was 0 and that token won the race whatever its probability)."""
    s = (seed ^ (seed >> 32)) & _M32
    h = _mix32(s ^ _mix32(((position & _M32) + 0x3C6EF372) & _M32))
    ids = torch.arange(first_id, first_id + vocab_size, device=seed.device, dtype=torch.int64)
    return hash_to_unit(_mix32((h[:, None] + ids[None, :] * 0x1B873593) & _M32))


def hash_to_unit(x: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64 tensor) -> float32 strictly inside (0, 1)."""
    return ((x >> 9).to(torch.float32) + 0.5) * 1.1920928955078125e-07


def log32(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 (Cephes logf, ~1 ulp) from IEEE adds and multiplies only,
    in the exact order of the Triton kernel's ``_log32``: bit-identical on CPU, GPU and the interpreter."""
    bits = x.view(torch.int32)
    e = (bits >> 23) - 126
    m = ((bits & 0x007FFFFF) | 0x3F000000).view(torch.float32)  # x = m * 2^e, m in [0.5, 1)
    small = m < _SQRT_HALF
    e = torch.where(small, e - 1, e).to(torch.float32)
    f = torch.where(small, (m + m) - 1.0, m - 1.0)
    z = f * f
    y = f * _LOG_POLY[0] + _LOG_POLY[1]
    for c in _LOG_POLY[2:]:
        y = y * f + c
    y = (y * f) * z
    y = y + e * _LOG_Q1
    y = y + z * -0.5
    return (f + y) + e * _LOG_Q2


def suppress_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, S] ids (-1 = none) -> [N, V] bool mask, without host syncs (-1 lands in a spare column)."""
    mask = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    idx = torch.where((ids >= 0) & (ids < vocab_size), ids, torch.full_like(ids, vocab_size))
    mask.scatter_(1, idx, True)
    return mask[:, :vocab_size]


def keep_mask(s: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """What top-k, top-p and min-p keep of scaled logits s [N, V] (-inf = suppressed), by sorting."""
    sorted_s, _ = s.sort(dim=-1, descending=True)
    vocab = s.shape[-1]
    neg_inf = torch.full_like(sorted_s[:, :1], float("-inf"))
    # top-k: keep values >= the k-th largest
    k = torch.where(st.top_k > 0, st.top_k.clamp(max=vocab), torch.full_like(st.top_k, vocab))
    keep = s >= sorted_s.gather(1, (k - 1)[:, None])
    # top-p: keep the smallest prefix whose mass reaches top_p (the token crossing it included)
    probs_sorted = torch.softmax(sorted_s, dim=-1)
    mass_before = probs_sorted.cumsum(-1) - probs_sorted
    last = (mass_before < st.top_p[:, None]).sum(-1, keepdim=True).clamp(min=1)
    keep &= s >= torch.where(st.top_p[:, None] >= 1.0, neg_inf, sorted_s.gather(1, last - 1))
    # min-p: keep tokens with p >= min_p * p_max
    mth = sorted_s[:, :1] + log32(st.min_p[:, None].clamp(min=1e-30))
    return keep & (s >= torch.where(st.min_p[:, None] > 0, mth, neg_inf))


def _distributions(logits: torch.Tensor, st: SamplingTensors):
    """(processed scaled logits, raw, policy and processed logprobs [N, V]) of float32 logits."""
    greedy = st.temperature == 0
    inv_t = 1.0 / torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    x = logits if st.penalties is None else apply_penalties(logits, st.penalties)
    s = x * inv_t[:, None]  # T = 1 for greedy rows
    raw_lp = torch.log_softmax(logits, dim=-1)
    policy_lp = torch.log_softmax(s, dim=-1)
    proc_s = s
    if st.suppress_ids is not None:
        proc_s = proc_s.masked_fill(suppress_mask(st.suppress_ids, logits.shape[-1]), float("-inf"))
    if st.needs_filter:
        proc_s = proc_s.masked_fill(~keep_mask(proc_s, st), float("-inf"))
    proc_lp = policy_lp if proc_s is s else torch.log_softmax(proc_s, dim=-1)  # renormalise what is left
    return proc_s, raw_lp, policy_lp, proc_lp


def mode_logprobs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[N, V] float32: each row's whole distribution in its ``logprobs_mode`` (what ``sample`` returns one of)."""
    _, raw_lp, policy_lp, proc_lp = _distributions(logits.float(), st)
    mode = st.mode[:, None]
    return torch.where(mode == MODE_RAW, raw_lp, torch.where(mode == MODE_PROCESSED, proc_lp, policy_lp))


def top_logprobs(logits: torch.Tensor, st: SamplingTensors, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k most likely tokens in its ``logprobs_mode``, descending: (ids [N, k] int64, [N, k] float32)."""
    values, ids = mode_logprobs(logits, st).topk(min(k, logits.shape[-1]), dim=-1)
    return ids, values


def sample_torch(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: logits [N, V] -> (token ids [N] int64, logprobs [N] float32)."""
    logits = logits.float()
    greedy = st.temperature == 0
    proc_s, raw_lp, policy_lp, proc_lp = _distributions(logits, st)
    if st.all_greedy:
        tokens = proc_s.argmax(-1)
    else:
        race = proc_s - log32(-log32(uniform_noise(st.seed, st.position, logits.shape[-1])))
        tokens = torch.where(greedy, proc_s.argmax(-1), race.argmax(-1))  # argmax(p / E) == argmax(s - log E)
    idx = tokens[:, None]
    lp = torch.where(
        st.mode == MODE_RAW,
        raw_lp.gather(1, idx)[:, 0],
        torch.where(st.mode == MODE_PROCESSED, proc_lp.gather(1, idx)[:, 0], policy_lp.gather(1, idx)[:, 0]),
    )
    return tokens, lp


def sample(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (token ids [N] int64, logprobs [N] float32): the fused kernel on CUDA, else torch."""
    if logits.is_cuda:
        from rollout.kernels.sampling import fused_sample

        return fused_sample(logits, st)
    return sample_torch(logits, st)
