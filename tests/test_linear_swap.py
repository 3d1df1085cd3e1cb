"""GEMM_SWAP_ROWS (rollout/layers/linear.py): a decode-sized batch's projections as the transposed product,
W @ x^T, copied back to [rows, N]. Off by default; on, the same sums (float32 here), through the model's fused
and row-parallel projections, and the engine still matches Hugging Face."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rollout.layers.linear as lin
from rollout.distributed.group import TPGroup
from rollout.kernels.knobs import knob_module
from rollout.layers.parallel import RowParallelLinear
from tests.engine_helpers import assert_matches_hf, greedy, make_engine, random_prompts
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the transposed products (torch.mm / torch.addmm) and of F.linear calls while the test runs."""
    calls = {"swap": 0, "linear": 0}
    mm, addmm, linear = torch.mm, torch.addmm, F.linear

    def count(key, fn):
        def wrapped(*a, **kw):
            calls[key] += 1
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(torch, "mm", count("swap", mm))
    monkeypatch.setattr(torch, "addmm", count("swap", addmm))
    monkeypatch.setattr(F, "linear", count("linear", linear))
    return calls


def test_off_by_default_and_set_by_bench_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.script_helpers import load_script

    assert lin.GEMM_SWAP_ROWS == 0 and lin.SKINNY_GEMM_ROWS == 0
    assert knob_module("GEMM_SWAP_ROWS") is lin and knob_module("SKINNY_GEMM_ROWS") is lin
    monkeypatch.setattr(lin, "GEMM_SWAP_ROWS", 0)
    bench = load_script("bench")
    bench.apply_decode_knobs(bench.parse_decode_knobs("GEMM_SWAP_ROWS=64"))
    assert lin.GEMM_SWAP_ROWS == 64


@pytest.mark.parametrize("bias", [False, True])
def test_swapped_product_equals_linear(bias: bool, counted: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 40, generator=g), (torch.randn(48, generator=g) if bias else None)
    monkeypatch.setattr(lin, "GEMM_SWAP_ROWS", 8)
    for rows, swapped in ((1, True), (8, True), (9, False)):
        x = torch.randn(rows, 40, generator=g)
        before = dict(counted)
        out = lin.linear(x, w, b)
        assert out.shape == (rows, 48) and out.is_contiguous()
        torch.testing.assert_close(out, x @ w.t() + (b if bias else 0), rtol=1e-5, atol=1e-5)
        assert (counted["swap"] - before["swap"], counted["linear"] - before["linear"]) == (
            (1, 0) if swapped else (0, 1)
        ), (rows, counted)
    empty = lin.linear(torch.empty(0, 40), w, b)  # no rows: F.linear's empty product, not an empty mm
    assert empty.shape == (0, 48)


def test_layers_route_through_it(counted: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    merged = lin.MergedLinear(16, (("q_proj", 8), ("k_proj", 4)), bias=True)
    row = RowParallelLinear(16, 12, False, TPGroup.single(), "what")
    x = torch.randn(4, 16)
    want = [F.linear(x, merged.weight, merged.bias), F.linear(x, row.weight)]
    monkeypatch.setattr(lin, "GEMM_SWAP_ROWS", 4)
    counted.update(swap=0, linear=0)
    got = [merged(x), row(x)]
    assert counted == {"swap": 2, "linear": 0}, counted
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: the q/k/v bias through addmm
def test_engine_matches_hf_with_swap(family: str, counted: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    hf = make_tiny_hf_model(family)
    prompts = random_prompts(3, hf.config.vocab_size, lo=5, hi=30, seed=3)
    monkeypatch.setattr(lin, "GEMM_SWAP_ROWS", 64)
    outs = make_engine(hf).generate(prompts, greedy(6))
    assert counted["swap"] > 0
    for p, o in zip(prompts, outs):
        assert_matches_hf(hf, p, o.outputs[0])
