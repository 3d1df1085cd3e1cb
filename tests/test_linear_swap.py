"""The transposed product (rollout/layers/linear.py's "swap"): a decode-sized batch's projections as W @ x^T,
copied back to [rows, N]. Off by default; routed per layer (rollout.layers.gemm_tune.route_rows, what the bench's
GEMM_SWAP_ROWS / SKINNY_GEMM_ROWS knobs set), the same sums (float32 here), through the model's fused and
row-parallel projections, and the engine still matches Hugging Face."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rollout.layers.linear as lin
from rollout.distributed.group import TPGroup
from rollout.kernels.knobs import knob_module
from rollout.layers.gemm_tune import route_knobs, route_rows
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


def test_off_by_default_and_set_by_bench_knobs() -> None:
    """No layer has a pick until something routes it; the bench's knobs route every tuned-kind projection of the
    engine's model (swap first, the Triton GEMM over the rows both name), and are no module constants any more."""
    from tests.script_helpers import load_script

    hf = make_tiny_hf_model("llama")
    model = make_engine(hf).model
    layers = [m for m in model.modules() if hasattr(m, "gemm_by_rows")]
    assert layers and all(m.gemm_by_rows == {} for m in layers)
    assert not hasattr(lin, "GEMM_SWAP_ROWS") and not hasattr(lin, "SKINNY_GEMM_ROWS")
    with pytest.raises(ValueError, match="no decode knob"):
        knob_module("GEMM_SWAP_ROWS")
    bench = load_script("bench")
    knobs = bench.parse_decode_knobs("GEMM_SWAP_ROWS=8,SKINNY_GEMM_ROWS=4")
    bench.apply_decode_knobs(knobs)  # the module constants' knobs: nothing to set for these
    route_knobs(model, knobs)
    want = {r: "skinny" if r <= 4 else "swap" for r in range(1, 9)}
    assert all(m.gemm_by_rows == want for m in layers)
    n_layers = len(layers)
    assert route_rows(model, "cublas", 2) == n_layers and layers[0].gemm_by_rows[1] == "cublas"
    for bad, match in ((("fast", 4), "GEMM method"), (("swap", -1), "max_rows"), (("swap", True), "max_rows")):
        with pytest.raises(ValueError, match=match):
            route_rows(model, *bad)


@pytest.mark.parametrize("bias", [False, True])
def test_swapped_product_equals_linear(bias: bool, counted: dict[str, int]) -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 40, generator=g), (torch.randn(48, generator=g) if bias else None)
    by_rows = dict.fromkeys(range(1, 9), "swap")
    for rows, swapped in ((1, True), (8, True), (9, False)):
        x = torch.randn(rows, 40, generator=g)
        before = dict(counted)
        out = lin.linear(x, w, b, by_rows)
        assert out.shape == (rows, 48) and out.is_contiguous()
        torch.testing.assert_close(out, x @ w.t() + (b if bias else 0), rtol=1e-5, atol=1e-5)
        assert (counted["swap"] - before["swap"], counted["linear"] - before["linear"]) == (
            (1, 0) if swapped else (0, 1)
        ), (rows, counted)
    empty = lin.linear(torch.empty(0, 40), w, b, by_rows)  # no rows: F.linear's empty product, not an empty mm
    assert empty.shape == (0, 48)


def test_layers_route_through_it(counted: dict[str, int]) -> None:
    merged = lin.MergedLinear(16, (("q_proj", 8), ("k_proj", 4)), bias=True)
    row = RowParallelLinear(16, 12, False, TPGroup.single(), "what")
    x = torch.randn(4, 16)
    want = [F.linear(x, merged.weight, merged.bias), F.linear(x, row.weight)]
    merged.gemm_by_rows[4] = row.gemm_by_rows[4] = "swap"
    counted.update(swap=0, linear=0)
    got = [merged(x), row(x)]
    assert counted == {"swap": 2, "linear": 0}, counted
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: the q/k/v bias through addmm
def test_engine_matches_hf_with_swap(family: str, counted: dict[str, int]) -> None:
    hf = make_tiny_hf_model(family)
    prompts = random_prompts(3, hf.config.vocab_size, lo=5, hi=30, seed=3)
    engine = make_engine(hf)
    route_rows(engine.model, "swap", 64)
    outs = engine.generate(prompts, greedy(6))
    assert counted["swap"] > 0
    for p, o in zip(prompts, outs):
        assert_matches_hf(hf, p, o.outputs[0])
