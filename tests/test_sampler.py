"""Sampler: seeded draws are batch-invariant, filters restrict the support, logprob modes are exact."""

import math

import torch

from rollout.layers.sampler import (
    MODES,
    SamplingTensors,
    hash_to_unit,
    keep_mask,
    log32,
    sample,
    sample_torch,
    uniform_noise,
)


def _st(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, position=None, mode="policy", needs=True):
    return SamplingTensors(
        temperature=torch.full((n,), float(temperature)),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), float(top_p)),
        min_p=torch.full((n,), float(min_p)),
        seed=torch.arange(n, dtype=torch.int64) if seed is None else torch.as_tensor(seed, dtype=torch.int64),
        position=torch.zeros(n, dtype=torch.int64) if position is None else torch.as_tensor(position),
        mode=torch.full((n,), MODES[mode], dtype=torch.int64),
        needs_filter=needs,
    )


def test_noise_is_a_pure_function_of_seed_position_id():
    a = uniform_noise(torch.tensor([5, 7]), torch.tensor([3, 3]), 50)
    b = uniform_noise(torch.tensor([7]), torch.tensor([3]), 50)
    assert torch.equal(a[1], b[0])
    assert not torch.equal(a[0], a[1])
    assert float(a.min()) > 0 and float(a.max()) < 1


def test_seeded_sample_is_batch_invariant():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    tok_all, lp_all = sample(logits, _st(4, seed=[11, 12, 13, 14], top_p=0.9))
    tok_one, lp_one = sample(logits[2:3], _st(1, seed=[13], top_p=0.9))
    assert tok_all[2] == tok_one[0] and torch.allclose(lp_all[2], lp_one[0])


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20000
    st = _st(n, temperature=0.7, seed=torch.arange(n), needs=False)
    toks, _ = sample(logits.expand(n, 4).contiguous(), st)
    freq = torch.bincount(toks, minlength=4).float() / n
    probs = torch.softmax(logits[0] / 0.7, -1)
    assert torch.allclose(freq, probs, atol=0.015), (freq, probs)


def test_filters_restrict_support():
    torch.manual_seed(1)
    logits = torch.randn(1, 50).expand(2000, 50).contiguous()
    order = logits[0].argsort(descending=True)
    toks, _ = sample(logits, _st(2000, top_k=3, seed=torch.arange(2000)))
    assert set(toks.tolist()) <= set(order[:3].tolist())
    probs = torch.softmax(logits[0], -1)
    toks, _ = sample(logits, _st(2000, min_p=0.5, seed=torch.arange(2000)))
    assert all(probs[t] >= 0.5 * probs.max() for t in toks.tolist())
    cum = probs[order].cumsum(0)
    nucleus = order[: int((cum < 0.6).sum()) + 1]
    toks, _ = sample(logits, _st(2000, top_p=0.6, seed=torch.arange(2000)))
    assert set(toks.tolist()) <= set(nucleus.tolist())
    assert len(set(toks.tolist())) == len(nucleus)


def test_logprob_modes():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    for mode in ("policy", "raw", "processed"):
        toks, lps = sample(logits, _st(3, temperature=0.5, top_k=5, mode=mode))
        for i in range(3):
            if mode == "policy":
                ref = torch.log_softmax(logits[i] / 0.5, -1)[toks[i]]
            elif mode == "raw":
                ref = torch.log_softmax(logits[i], -1)[toks[i]]
            else:
                scaled = logits[i] / 0.5
                kth = scaled.topk(5).values[-1]
                ref = torch.log_softmax(scaled.masked_fill(scaled < kth, -math.inf), -1)[toks[i]]
            assert abs(float(lps[i]) - float(ref)) < 1e-5, mode


def test_greedy_and_suppression():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    st = _st(2, temperature=0.0, needs=False)
    st.suppress_ids = torch.tensor([[-1], [1]])
    toks, lps = sample(logits, st)
    assert toks.tolist() == [1, 2]
    ref = torch.log_softmax(logits[1], -1)
    assert abs(float(lps[0]) - float(ref[1])) < 1e-6 and abs(float(lps[1]) - float(ref[2])) < 1e-6


def test_noise_never_reaches_one():
    """23 bits + 0.5 are exact in float32: the largest hash maps below 1 (24 bits rounded to 1.0, so
    E = -log U was 0 and that token won the race whatever its probability: ~1% of draws at 152K vocab)."""
    assert float(hash_to_unit(torch.tensor([0xFFFFFFFF]))) < 1.0
    assert float(hash_to_unit(torch.tensor([0]))) > 0.0
    u = uniform_noise(torch.arange(4), torch.zeros(4, dtype=torch.int64), 1 << 16)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0
    assert torch.isfinite(log32(-log32(u))).all()


def test_log32_is_accurate():
    x = torch.cat([torch.rand(20000) * 30 + 1e-7, torch.tensor([2.0**-24, 1 - 2.0**-24, 1.0, 0.5, 2.0])])
    err = (log32(x).double() - x.double().log()).abs() / x.double().log().abs().clamp(min=1e-30)
    assert float(err.max()) < 3e-7
    assert float(log32(torch.tensor([1.0]))) == 0.0


def test_keep_mask_keeps_whole_tie_groups():
    """Kept iff fewer than k tokens / less than top_p mass lie strictly above the value: ties go together."""
    s = torch.tensor([[4.0, 3.0, 3.0, 3.0, 2.0, 0.0]])
    p = torch.softmax(s[0], -1)
    assert keep_mask(s, _st(1, top_k=2)).tolist() == [[True, True, True, True, False, False]]
    st = _st(1, top_p=float(p[0] + 0.5 * p[1]))  # crosses inside the group of 3s
    assert keep_mask(s, st).tolist() == [[True, True, True, True, False, False]]
    st = _st(1, top_p=float(p[0] * 0.9))
    assert keep_mask(s, st).tolist() == [[True, False, False, False, False, False]]
    st = _st(1, min_p=float(p[4] / p[0]))
    assert keep_mask(s, st).tolist() == [[True, True, True, True, True, False]]


def test_top_p_mass_excludes_suppressed_tokens():
    """top-p applies to the distribution actually sampled: suppressed ids (EOS before min_tokens) are out."""
    logits = torch.tensor([[5.0, 1.0, 0.9, -3.0]]).expand(3000, 4).contiguous()
    st = _st(3000, top_p=0.6, seed=torch.arange(3000))
    st.suppress_ids = torch.zeros(3000, 1, dtype=torch.int64)
    toks, _ = sample(logits, st)
    assert set(toks.tolist()) == {1, 2}  # of the rest, 1 alone has mass ~0.52 < 0.6


def test_cpu_sample_is_the_reference():
    torch.manual_seed(3)
    logits = torch.randn(5, 64)
    st = _st(5, top_k=10, seed=[1, 2, 3, 4, 5])
    a, b = sample(logits, st), sample_torch(logits, st)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
