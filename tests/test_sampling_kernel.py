"""Fused sampling kernel against the torch reference sampler, on the CPU through Triton's interpreter.

Like tests/test_kernels.py, every check runs in one child process started with TRITON_INTERPRET=1 (this
file run as a script); the pytest process never imports the kernel modules. The kernel must give the
reference's tokens exactly for the same seeds (its noise is bit-identical: checked directly) and its
logprobs within 1e-5, in every mode, with and without top-k / top-p / min-p / suppressed ids. Small
blocks (and few thresholds per search pass) make every row span several blocks and search passes.
Tie cases: integer logits put equal values on the top-k and top-p boundaries; the ``processed``
logprob exposes the kept set's mass, so a kept set differing from the sorted definition shows up.
"""

from __future__ import annotations

import pytest
import torch

from rollout.layers.sampler import MODES, SamplingTensors, keep_mask, log32, sample_torch, uniform_noise
from tests.interpreter import child_main, child_verdicts

SMALL = dict(block=64, search_block=64, num_thresholds=4)  # several blocks and search passes a row
LARGE = dict(block=256, search_block=256, num_thresholds=8)  # the interpreter's cost is per block


def make_st(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, mode="policy", seed0=0, suppress=None,
            needs_filter=None, all_greedy=False) -> SamplingTensors:  # fmt: skip
    """Per-row settings; scalars broadcast, lists give one value per row (mode: names)."""

    def col(v, dtype):
        return torch.as_tensor(v, dtype=dtype) if isinstance(v, list) else torch.full((n,), v, dtype=dtype)

    modes = [MODES[x] for x in mode] if isinstance(mode, list) else MODES[mode]
    st = SamplingTensors(
        temperature=col(temperature, torch.float32), top_k=col(top_k, torch.int64), top_p=col(top_p, torch.float32),
        min_p=col(min_p, torch.float32), seed=torch.arange(n, dtype=torch.int64) * 7919 + seed0,
        position=torch.arange(n, dtype=torch.int64) % 5, mode=col(modes, torch.int64),
        suppress_ids=None if suppress is None else torch.as_tensor(suppress, dtype=torch.int64),
    )  # fmt: skip
    st.needs_filter = bool((st.top_k > 0).any() or (st.top_p < 1).any() or (st.min_p > 0).any())
    if needs_filter is not None:
        st.needs_filter = needs_filter
    st.all_greedy = all_greedy
    return st


def check_same(logits: torch.Tensor, st: SamplingTensors, tol: float = 1e-5, **kw) -> None:
    from rollout.kernels.sampling import fused_sample

    ref_tok, ref_lp = sample_torch(logits, st)
    kw = {"parts": 1, **(kw or SMALL)}  # the one-kernel path unless a check asks for parts
    tok, lp = fused_sample(logits, st, **kw)
    assert torch.equal(tok, ref_tok), f"tokens differ at rows {(tok != ref_tok).nonzero().flatten().tolist()}"
    err = (lp - ref_lp).abs().max().item()
    assert err <= tol, f"logprob error {err:.3g} > {tol}: {lp.tolist()} vs {ref_lp.tolist()}"


def _logits(n, v, scale=3.0, seed=0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


def check_noise_bit_identical() -> None:
    """log32 and the race noise log(-log U) equal the torch reference's bit for bit."""
    import triton
    import triton.language as tl

    from rollout.kernels import sampling_math

    globals()["sm"] = sampling_math  # a jit function resolves names in its module's globals

    @triton.jit
    def kernel(x_ptr, y_ptr, seed_ptr, pos_ptr, noise_ptr, n, V, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, sm.log32(tl.load(x_ptr + offs, mask=offs < n, other=1.0)), mask=offs < n)  # noqa: F821
        row = tl.program_id(0)
        h = sm.row_hash(tl.load(seed_ptr + row), tl.load(pos_ptr + row))  # noqa: F821
        tl.store(noise_ptr + row * V + offs, sm.log_exp_noise(h, offs), mask=offs < V)  # noqa: F821

    x = torch.cat([torch.rand(400) * 30 + 1e-6, torch.tensor([2.0**-24, 1 - 2.0**-24, 1.0, 0.5, 0.70710677, 17.0])])
    seed = torch.tensor([0, 1, -5, 2**40 + 3, 2**62], dtype=torch.int64)
    pos = torch.tensor([0, 7, 3, 2**33 + 1, 99], dtype=torch.int64)
    y, noise = torch.empty_like(x), torch.empty(5, 512)
    kernel[(5,)](x, y, seed, pos, noise, x.numel(), 512, BLOCK=512)
    assert torch.equal(y.view(torch.int32), log32(x).view(torch.int32))
    ref = log32(-log32(uniform_noise(seed, pos, 512)))
    assert torch.equal(noise.view(torch.int32), ref.view(torch.int32))


def check_sampled_modes() -> None:
    """Temperature sampling, every logprob mode, greedy rows mixed in, logits spanning several blocks."""
    logits = _logits(12, 300)
    modes = ["policy", "raw", "processed"] * 4
    check_same(logits, make_st(12, temperature=1.0, mode=modes, needs_filter=False))
    temps = [0.7, 0.0, 1.3, 0.05] * 3
    check_same(logits, make_st(12, temperature=temps, mode=modes, needs_filter=False, seed0=3))


def check_greedy_and_suppression() -> None:
    """Greedy (all-greedy fast path and mixed), suppressed ids (-1 padded, duplicated, out of range,
    and the argmax itself), and a suppressed token so likely that the rest underflows against it."""
    logits = _logits(6, 200)
    logits[:, 17] = 10.0
    logits[5, 3] = 200.0
    sup = [[17, -1, -1], [17, 17, 5], [-1, -1, -1], [17, 500, 0], [3, -1, 17], [3, -1, -1]]
    modes = ["policy", "processed", "raw", "processed", "policy", "processed"]
    check_same(logits, make_st(6, temperature=0.0, mode=modes, suppress=sup, all_greedy=True))
    check_same(logits, make_st(6, temperature=[0.0, 1.0, 0.5, 0.0, 2.0, 0.9], mode=modes, suppress=sup))
    ties = torch.zeros(2, 130)
    ties[:, [5, 70, 129]] = 1.0  # greedy ties go to the lowest id, across blocks too
    check_same(ties, make_st(2, temperature=0.0, all_greedy=True, suppress=[[-1], [5]]))


def check_filters_processed() -> None:
    """top-k, top-p, min-p and their mix, processed logprobs (the kept-mass search) and sampled tokens."""
    logits = _logits(8, 300, scale=2.0, seed=1)
    check_same(logits, make_st(8, top_p=[0.9, 0.5, 0.99, 1.0] * 2, mode="processed"), **LARGE)
    check_same(logits, make_st(8, top_k=[5, 1, 400, 0] * 2, mode="processed", temperature=0.8), **LARGE)
    check_same(logits, make_st(8, min_p=[0.1, 0.5, 1.0, 0.0] * 2, mode="processed", temperature=1.5), **LARGE)
    check_same(logits[:4], make_st(4, top_k=[20, 0] * 2, top_p=0.8, min_p=[0.0, 0.05] * 2,
                               mode=["processed", "policy", "raw", "processed"],
                               temperature=[1.0, 0.0, 0.6, 1.0], suppress=[[4, -1]] * 4))  # fmt: skip


def check_filters_many_draws() -> None:
    """Sampled tokens under filters over many seeds from one context: the rejection loop's winners."""
    row = _logits(1, 200, scale=1.5, seed=2)
    logits = row.expand(24, 200).contiguous()
    check_same(logits, make_st(24, top_p=0.7, seed0=11, suppress=[[int(row.argmax()), -1]] * 24), **LARGE)
    check_same(logits, make_st(24, top_k=3, min_p=0.3, seed0=12), **LARGE)


def check_rejection_fallback() -> None:
    """Flat rows: top-k rejects nearly every winner (straight to the threshold search) and a low top-p
    rejects often (up to 4 rounds, then the search); tokens stay the reference's."""
    flat = _logits(1, 200, scale=0.3, seed=3).expand(16, 200).contiguous()
    check_same(flat, make_st(16, top_k=[3, 1] * 8, seed0=21), **LARGE)
    check_same(flat, make_st(16, top_p=0.2, mode=["policy", "processed"] * 8, seed0=22), **LARGE)


def _tie_row() -> torch.Tensor:
    """Integer logits: 4, then three 3s, four 2s, the rest 0 or less (equal values across blocks)."""
    row = torch.full((1, 160), -1.0)
    row[0, 100] = 4.0
    row[0, [7, 64, 150]] = 3.0
    row[0, [1, 65, 66, 140]] = 2.0
    row[0, 10:20] = 0.0
    return row


def check_tied_boundaries() -> None:
    """Kept sets with ties on the boundary equal the sorted definition (all equal values kept)."""
    row = _tie_row()
    p = torch.softmax(row[0], -1)
    p4, p3 = float(p[100]), float(p[7])
    top_ps = [p4 * 0.5, p4 + 0.5 * p3, p4 + 2.5 * p3, p4 + 3 * p3 + 0.01]
    st = make_st(4, top_p=top_ps, mode="processed", seed0=5)
    kept = keep_mask(row.expand(4, -1), st).sum(-1).tolist()
    assert kept == [1, 4, 4, 8], kept  # whole tie groups only
    check_same(row.expand(4, -1).contiguous(), st, **LARGE)
    check_same(row.expand(5, -1).contiguous(), make_st(5, top_k=[1, 2, 3, 4, 5], mode="processed"), **LARGE)
    check_same(row.expand(2, -1).contiguous(), make_st(2, min_p=float(p[1] / p[100]), mode="processed"))
    many = make_st(24, top_p=p4 + 0.5 * p3, top_k=[0, 2] * 12, seed0=7)  # sampled: only 4 and the 3s
    check_same(row.expand(24, -1).contiguous(), many, **LARGE)


def check_errors() -> None:
    from rollout.kernels.sampling import fused_sample

    with pytest.raises(ValueError, match="logits"):
        fused_sample(torch.zeros(4, dtype=torch.int64), make_st(1))
    tok, lp = fused_sample(torch.zeros(0, 10), make_st(0))
    assert tok.shape == (0,) and lp.shape == (0,)
    check_same(torch.randn(200, 4).t()[1:2], make_st(1))  # strided (non-contiguous) logits


def _penalties(n: int, v: int, rep, pres, freq, seed: int = 0):
    """A history tensor with prompt tokens and output counts (row n is all zero), rows in a shuffled order."""
    from rollout.layers.sampler import Penalties

    g = torch.Generator().manual_seed(seed)
    hist = torch.zeros(n + 1, v, dtype=torch.int32)
    for r in range(n):
        hist[r, torch.randint(0, v, (v // 6,), generator=g)] |= 1  # in the prompt
        hist[r].index_add_(0, torch.randint(0, v, (v // 3,), generator=g), torch.full((v // 3,), 2, dtype=torch.int32))
    rows = torch.randperm(n, generator=g)

    def col(x):
        return torch.as_tensor(x if isinstance(x, list) else [x] * n, dtype=torch.float32)

    return Penalties(hist, rows, col(rep), col(pres), col(freq))


def check_penalties() -> None:
    """Repetition / presence / frequency penalties: the kernel draws the reference's tokens, in every mode,
    with filters and suppressed ids, greedy and sampled; rows without penalties are untouched."""
    logits = _logits(8, 300, scale=2.0, seed=4)
    logits[0, :5] = torch.tensor([5.0, -5.0, 0.0, 7.0, 7.0])
    reps, pres, freqs = [1.3, 0.7, 1.0, 2.0] * 2, [0.0, 1.5, -1.0, 0.5] * 2, [0.5, 0.0, 2.0, -0.3] * 2
    modes = ["policy", "processed", "raw", "policy"] * 2
    st = make_st(8, temperature=[1.0, 0.0, 0.7, 1.2] * 2, mode=modes, needs_filter=False)
    st.penalties = _penalties(8, 300, reps, pres, freqs)
    check_same(logits, st)
    st = make_st(8, top_p=[0.9, 0.5] * 4, top_k=[0, 7] * 4, mode=modes, suppress=[[3, -1]] * 8, seed0=9)
    st.penalties = _penalties(8, 300, reps, pres, freqs, seed=1)
    check_same(logits, st, **LARGE)
    greedy = make_st(8, temperature=0.0, all_greedy=True, needs_filter=False)
    greedy.penalties = _penalties(8, 300, 1.0, 0.0, 0.0)  # all off: the unpenalised tokens
    check_same(logits, greedy)
    assert torch.equal(sample_torch(logits, greedy)[0], logits.argmax(-1))
    greedy.penalties = _penalties(8, 300, 5.0, 2.0, 2.0)
    assert not torch.equal(sample_torch(logits, greedy)[0], logits.argmax(-1)), "penalties changed nothing"


def check_split_parts() -> None:
    """The first pass split into parts per row (merged by a second kernel): the reference's tokens and logprobs
    for sampled and greedy rows in every mode, suppressed ids, penalties, winners and ties in different parts
    (the lowest id wins across parts as within one), bf16 logits; filtered batches ignore ``parts``."""
    logits = _logits(12, 300)
    modes = ["policy", "raw", "processed"] * 4
    temps = [0.7, 0.0, 1.3, 1.0] * 3
    for parts in (2, 3, 5, 64):  # 64: capped at one block per part
        check_same(logits, make_st(12, temperature=temps, mode=modes, needs_filter=False, seed0=parts), parts=parts,
                   **SMALL)
    check_same(logits.bfloat16(), make_st(12, temperature=temps, mode=modes, needs_filter=False), parts=3, **SMALL)
    check_same(logits.bfloat16(), make_st(12, temperature=temps, mode=modes, needs_filter=False), parts=1, **SMALL)
    ties = torch.zeros(2, 130)
    ties[:, [5, 70, 129]] = 1.0  # one tied maximum in each of three parts
    check_same(ties, make_st(2, temperature=0.0, all_greedy=True, suppress=[[-1], [5]]), parts=3, **SMALL)
    sup = [[17, -1, -1], [17, 17, 5], [-1, -1, -1], [17, 500, 0], [3, -1, 17], [3, -1, -1]]
    check_same(logits[:6], make_st(6, temperature=[0.0, 1.0, 0.5, 0.0, 2.0, 0.9], mode=modes[:6], suppress=sup,
                                   needs_filter=False), parts=4, **SMALL)  # fmt: skip
    st = make_st(8, temperature=[1.0, 0.0, 0.7, 1.2] * 2, mode=modes[:8], needs_filter=False)
    st.penalties = _penalties(8, 300, [1.3, 0.7, 1.0, 2.0] * 2, [0.0, 1.5, -1.0, 0.5] * 2, [0.5, 0.0, 2.0, -0.3] * 2)
    check_same(logits[:8], st, parts=3, **SMALL)
    check_same(logits[:8], make_st(8, top_p=0.9, top_k=[0, 7] * 4, mode="processed"), parts=3, **LARGE)
    dead = logits[:4].clone()
    dead[:, :64] = float("-inf")  # a whole part -inf: it adds nothing to the sums and never wins the race
    check_same(dead, make_st(4, temperature=[1.0, 0.0, 0.5, 1.0], mode=["policy", "raw", "processed", "raw"],
                             needs_filter=False), parts=5, **SMALL)  # fmt: skip
    from rollout.kernels.sampling import fused_sample, sample_parts

    with pytest.raises(ValueError, match="parts"):
        fused_sample(logits, make_st(12), parts=0)
    assert sample_parts(128, 151936, 2048, 132) == 4 and sample_parts(1024, 151936, 2048, 132) == 1
    assert sample_parts(1, 300, 64, 132) == 5  # never more parts than blocks


CHECKS = {
    "noise_bit_identical": check_noise_bit_identical,
    "sampled_modes": check_sampled_modes,
    "greedy_and_suppression": check_greedy_and_suppression,
    "filters_processed": check_filters_processed,
    "filters_many_draws": check_filters_many_draws,
    "rejection_fallback": check_rejection_fallback,
    "tied_boundaries": check_tied_boundaries,
    "errors": check_errors,
    "penalties": check_penalties,
    "split_parts": check_split_parts,
}


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str]:
    return child_verdicts(__file__)


@pytest.mark.parametrize("name", list(CHECKS))
def test_sampling_kernel(verdicts: dict[str, str], name: str) -> None:
    assert verdicts[name] == "ok", verdicts[name]


if __name__ == "__main__":
    child_main(CHECKS)
