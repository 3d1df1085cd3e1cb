"""Sampler: seeded draws are batch-invariant, filters restrict the support, logprob modes are exact."""

import math

import torch

from rollout.layers.sampler import MODES, SamplingTensors, sample, uniform_noise


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
