"""The fused sampler on the GPU at real shapes (256 rows x 151,936 vocab, qwen2.5's) against the torch
reference, inside a CUDA graph, and a frequency test of its draws against the exact distribution.

Logits imitate an LM head: a Gaussian bulk plus a few dozen strong candidates per row, some steps
rounded through bf16 first (as a bf16 lm_head's are: many exact ties, also on the top-p boundary).
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from rollout.kernels.sampling import fused_sample  # noqa: E402
from rollout.layers.sampler import MODES, SamplingTensors, keep_mask, sample, sample_torch  # noqa: E402

DEV = torch.device("cuda")
N, V = 256, 151936


def lm_logits(n: int, step: int, bf16: bool) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(1000 + step)
    x = torch.randn(n, V, device=DEV, generator=gen) * 2.0
    peaks = torch.randint(0, V, (n, 40), device=DEV, generator=gen)
    x.scatter_add_(1, peaks, 6.0 + 6.0 * torch.rand(n, 40, device=DEV, generator=gen))
    return x.bfloat16().float() if bf16 else x


def mixed_settings(step: int) -> SamplingTensors:
    """Four groups of 64 rows: t=1; t=1 top_p .95; t=.8 top_k 50 min_p .05 (some greedy); processed
    logprobs with top_p .9 and a suppressed id. Modes rotate through policy / processed / raw."""
    g = torch.arange(N, device=DEV) // 64
    temp = torch.tensor([1.0, 1.0, 0.8, 0.7], device=DEV)[g]
    temp[128:192:8] = 0.0
    st = SamplingTensors(
        temperature=temp,
        top_k=torch.where(g == 2, 50, 0).long(),
        top_p=torch.tensor([1.0, 0.95, 1.0, 0.9], device=DEV)[g],
        min_p=torch.where(g == 2, 0.05, 0.0).float(),
        seed=torch.arange(N, device=DEV, dtype=torch.int64) * 1_000_003 + 17,
        position=torch.full((N,), step, device=DEV, dtype=torch.int64),
        mode=torch.where(g == 3, MODES["processed"], torch.arange(N, device=DEV) % 3).long(),
        suppress_ids=torch.where(g[:, None] == 3, 151643, -1).long().expand(N, 2).contiguous(),
        needs_filter=True,
    )
    return st


def test_same_tokens_as_reference_over_64_steps():
    mismatches, worst_lp = [], 0.0
    for step in range(64):
        logits = lm_logits(N, step, bf16=step % 2 == 1)
        st = mixed_settings(step)
        ref_tok, ref_lp = sample_torch(logits, st)
        tok, lp = sample(logits, st)  # CUDA logits: the fused kernel
        bad = (tok != ref_tok).nonzero().flatten().tolist()
        mismatches += [(step, r, int(tok[r]), int(ref_tok[r])) for r in bad]
        worst_lp = max(worst_lp, float((lp - ref_lp).abs().max()))
    print(f"\n256 x 64 sampled steps: {len(mismatches)} token mismatches, max logprob error {worst_lp:.2e}")
    assert not mismatches, mismatches[:20]
    assert worst_lp < 5e-5


def test_greedy_and_plain_batches_match():
    """The host flags' fast paths: all-greedy (no noise) and no filter."""
    logits = lm_logits(N, 99, bf16=True)
    st = mixed_settings(0)
    st.suppress_ids, st.needs_filter, st.top_k, st.top_p, st.min_p = (
        None,
        False,
        st.top_k * 0,
        st.top_p * 0 + 1,
        st.min_p * 0,
    )
    for all_greedy in (False, True):
        if all_greedy:
            st.temperature = torch.zeros_like(st.temperature)
        st.all_greedy = all_greedy
        ref_tok, ref_lp = sample_torch(logits, st)
        tok, lp = fused_sample(logits, st)
        assert torch.equal(tok, ref_tok) and float((lp - ref_lp).abs().max()) < 5e-5
    assert torch.equal(tok, logits.argmax(-1))


def test_captured_in_a_cuda_graph():
    """No host syncs: a graph captured once replays with new logits and settings written in place."""
    logits = lm_logits(N, 5, bf16=False)
    st = mixed_settings(5)
    fused_sample(logits, st)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tok, lp = fused_sample(logits, st)
    for step in (6, 7):
        logits.copy_(lm_logits(N, step, bf16=True))
        st.position.fill_(step)
        st.top_p[64:128] = 0.8 if step == 7 else 0.95
        graph.replay()
        ref_tok, ref_lp = sample_torch(logits, st)
        assert torch.equal(tok, ref_tok) and float((lp - ref_lp).abs().max()) < 5e-5


def _chi2_critical(dof: int, z: float = 3.72) -> float:
    """Wilson-Hilferty: the chi-square quantile at normal quantile z (3.72 ~ p = 1e-4)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Chi-square over tokens expected >= 5 times, the rest pooled into one bin."""
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = counts[big].double(), exp[big].double()
    obs_r, exp_r = counts[~big].sum().double(), exp[~big].sum().double()
    stat = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    if exp_r >= 5:
        stat += float((obs_r - exp_r) ** 2 / exp_r)
    return stat, int(big.sum()) + int(exp_r >= 5) - 1


def test_frequencies_match_the_distribution():
    """16K draws (T = 0.8, top_p = 0.95) from one context: chi-square and every token's frequency
    within the spread of an ideal sampler, nothing outside the nucleus."""
    n = 16384
    row = lm_logits(1, 123, bf16=True)
    logits = row.expand(n, V)  # stride 0: one row in memory
    col = torch.ones(n, device=DEV)
    st = SamplingTensors(
        temperature=col * 0.8, top_k=torch.zeros(n, device=DEV, dtype=torch.int64), top_p=col * 0.95,
        min_p=col * 0, seed=torch.arange(n, device=DEV, dtype=torch.int64), position=torch.zeros_like(col).long(),
        mode=torch.zeros(n, device=DEV, dtype=torch.int64), needs_filter=True,
    )  # fmt: skip
    tok, _ = fused_sample(logits, st)
    s = row * (1.0 / 0.8)
    kept = keep_mask(s, SamplingTensors(*(t[:1] for t in (st.temperature, st.top_k, st.top_p, st.min_p,
                                                          st.seed, st.position, st.mode))))[0]  # fmt: skip
    probs = torch.softmax(s[0].masked_fill(~kept, float("-inf")), -1)
    counts = torch.bincount(tok, minlength=V).double()
    assert float(counts[~kept].sum()) == 0, "drew tokens outside the nucleus"
    stat, dof = _chi2(counts, probs, n)
    ideal = torch.bincount(torch.multinomial(probs, n, replacement=True), minlength=V).double()
    ideal_stat, _ = _chi2(ideal, probs, n)
    z = (counts - n * probs) / (n * probs * (1 - probs)).clamp(min=1e-12).sqrt()
    print(f"\nnucleus {int(kept.sum())} tokens; chi2 {stat:.1f} (ideal sampler {ideal_stat:.1f}) on {dof} dof, "
          f"critical {_chi2_critical(dof):.1f}; max |z| {float(z[kept].abs().max()):.2f}")  # fmt: skip
    assert stat < _chi2_critical(dof)
    assert float(z[kept].abs().max()) < 5.0
