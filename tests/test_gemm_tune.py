"""The projections' GEMM tuned per decode batch size (rollout/layers/gemm_tune.py, EngineConfig.gemm_autotune):
each group of layers with one weight shape gets the method timed fastest, cuBLAS unless another wins by more
than the margin; the layers then run it for that many rows only, and the model's answers stay Hugging Face's."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

import rollout.layers.gemm_tune as gt
import rollout.layers.linear as lin
from rollout.config import EngineConfig
from rollout.distributed.group import TPGroup
from rollout.layers.parallel import RowParallelLinear
from tests.engine_helpers import assert_matches_hf, greedy, make_engine, random_prompts
from tests.tiny_models import make_tiny_hf_model


class FakeTimer:
    """Runs what it is given once and answers the microseconds ``costs`` sets for the method it ran, per group
    (by weight shape); records each (shape, method) timed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, costs: dict) -> None:
        self.costs, self.timed, self._last = costs, [], None
        self.most_alive, refs = 0, []  # outputs of a group's GEMMs held at once (one: each dropped at once)
        real = gt.gemm

        def spy(x, weight, bias, method):
            self._last = (tuple(weight.shape), method)
            out = real(x, weight, bias, method)
            refs.append(weakref.ref(out))
            self.most_alive = max(self.most_alive, sum(r() is not None for r in refs))
            return out

        monkeypatch.setattr(gt, "gemm", spy)

    def __call__(self, fn) -> float:
        fn()
        shape, method = self._last
        self.timed.append((shape, method))
        return self.costs[shape][method]


def _layers() -> torch.nn.Module:
    m = torch.nn.Module()
    m.a = lin.MergedLinear(16, (("q_proj", 8), ("k_proj", 4)), bias=True)
    m.b = lin.MergedLinear(16, (("q_proj", 8), ("k_proj", 4)), bias=True)
    m.c = RowParallelLinear(16, 24, False, TPGroup.single(), "what")
    m.plain = torch.nn.Linear(16, 4)  # not a projection of ours: left alone
    return m


def test_groups_by_shape_and_picks_the_fastest_past_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _layers()
    groups = gt.tunable_linears(m)
    assert sorted(len(v) for v in groups.values()) == [1, 2]
    costs = {(12, 16): {"cublas": 10.0, "swap": 9.0}, (24, 16): {"cublas": 10.0, "swap": 9.8}}
    timer = FakeTimer(monkeypatch, costs)
    picks = gt.tune_gemms(m, 8, timer=timer)
    # on the CPU the Triton GEMM is never timed; swap wins by 10% (taken) and by 2% (under the 3% margin: cuBLAS)
    assert sorted(timer.timed) == [((12, 16), "cublas"), ((12, 16), "swap"), ((24, 16), "cublas"), ((24, 16), "swap")]
    assert timer.most_alive == 1  # a group's outputs are not kept (in a capture, each reuses the last one's memory)
    assert m.a.gemm_by_rows == m.b.gemm_by_rows == {8: "swap"} and m.c.gemm_by_rows == {8: "cublas"}
    assert not hasattr(m.plain, "gemm_by_rows")
    by_shape = {p.shape: p for p in picks}
    assert by_shape[(12, 16)].layers == 2 and by_shape[(12, 16)].method == "swap"
    assert by_shape[(24, 16)].as_record() == {"rows": 8, "shape": [24, 16], "layers": 1, "method": "cublas",
                                              "us": {"cublas": 10.0, "swap": 9.8}}
    gt.tune_gemms(m, 16, timer=FakeTimer(monkeypatch, {k: {"cublas": 1.0, "swap": 2.0} for k in costs}))
    assert m.a.gemm_by_rows == {8: "swap", 16: "cublas"}  # one choice per row count
    with pytest.raises(ValueError, match="rows must be >= 1"):
        gt.tune_gemms(m, 0, timer=timer)
    with pytest.raises(ValueError, match=r"margin must be in \[0, 1\)"):
        gt.tune_gemms(m, 8, timer=timer, margin=1.5)


def test_a_method_that_fails_is_left_out(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The transposed product raising while it is timed (as a Triton compile or a capture could on some GPU): the
    group is tuned without it, with a warning naming it, and nothing else changes; cuBLAS failing is an error."""
    m = _layers()
    costs = {(12, 16): {"cublas": 10.0, "swap": 1.0}, (24, 16): {"cublas": 10.0, "swap": 1.0}}
    timer = FakeTimer(monkeypatch, costs)

    def failing(fn) -> float:
        t = timer(fn)
        if timer.timed[-1][1] == "swap":
            raise RuntimeError("compile failed")
        return t

    picks = gt.tune_gemms(m, 8, timer=failing)
    assert {p.method for p in picks} == {"cublas"} and all(dict(p.us).keys() == {"cublas"} for p in picks)
    assert m.a.gemm_by_rows == {8: "cublas"}
    assert "gemm_autotune: swap failed at 8 rows on weights [12, 16]; skipped" in caplog.text

    def cublas_fails(fn) -> float:
        timer(fn)
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        gt.tune_gemms(m, 16, timer=cublas_fails)


def test_layers_run_their_pick_for_that_row_count_only(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _layers()
    m.a.gemm_by_rows.update({4: "swap"})
    m.c.gemm_by_rows.update({4: "cublas"})
    ran = []
    real = lin.gemm
    monkeypatch.setattr(lin, "gemm", lambda x, w, b, method: ran.append(method) or real(x, w, b, method))
    for rows, want in ((4, ["swap", "cublas"]), (5, [])):  # 5 rows: no pick, straight to F.linear
        ran.clear()
        x = torch.randn(rows, 16)
        torch.testing.assert_close(m.a(x), F.linear(x, m.a.weight, m.a.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.c(x), F.linear(x, m.c.weight), rtol=1e-5, atol=1e-5)
        assert ran == want, (rows, ran)
    with pytest.raises(ValueError, match="GEMM method must be one of"):
        real(torch.randn(2, 16), m.a.weight, None, "cutlass")


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_engine_matches_hf_with_tuned_gemms(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every projection on the transposed product at the decode batch sizes (as if it had won), the rest on
    cuBLAS: the engine's tokens and logprobs are still HF's."""
    hf = make_tiny_hf_model(family)
    prompts = random_prompts(3, hf.config.vocab_size, lo=5, hi=30, seed=3)
    engine = make_engine(hf)

    def one_us(fn) -> float:
        fn()
        return 1.0

    for b in (1, 2, 3):
        gt.tune_gemms(engine.model, b, timer=one_us, methods=())  # cuBLAS alone
    for mod in gt.tunable_linears(engine.model).values():
        for layer in mod:
            assert layer.gemm_by_rows == {1: "cublas", 2: "cublas", 3: "cublas"}
            layer.gemm_by_rows.update({1: "swap", 2: "swap", 3: "swap"})
    swaps = []
    addmm, mm = torch.addmm, torch.mm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: swaps.append(1) or addmm(*a, **k))
    monkeypatch.setattr(torch, "mm", lambda *a, **k: swaps.append(1) or mm(*a, **k))
    outs = engine.generate(prompts, greedy(6))
    assert swaps
    for p, o in zip(prompts, outs):
        assert_matches_hf(hf, p, o.outputs[0])


def test_config_field() -> None:
    assert EngineConfig().gemm_autotune is False
    assert EngineConfig(gemm_autotune=True).gemm_autotune is True
    with pytest.raises(TypeError, match="gemm_autotune must be true or false, got 'yes'"):
        EngineConfig(gemm_autotune="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gemm_autotune must be true or false, got None"):
        EngineConfig(gemm_autotune=None)  # type: ignore[arg-type]


def test_bench_flag_sets_it() -> None:
    from tests.script_helpers import load_script

    bench = load_script("bench")
    assert bench.build_parser().parse_args(["--gemm-autotune"]).gemm_autotune is True
    assert bench.build_parser().parse_args([]).gemm_autotune is False
