"""bench/step_profile.py's device_gaps: the idle time inside a step (between a graph's kernels) apart from the
time between steps, overlapping intervals counted once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def step_profile():
    spec = importlib.util.spec_from_file_location("step_profile", ROOT / "bench" / "step_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gaps_inside_and_between_steps(step_profile):
    # two steps of three kernels: 2 us and 3 us gaps inside each, 100 us between the steps
    step = [(0.0, 10.0), (12.0, 20.0), (23.0, 30.0)]
    spans = step + [(s + 130.0, e + 130.0) for s, e in step]
    g = step_profile.device_gaps(spans)
    assert g == dict(kernels=6, busy_us=50.0, inner_gap_us=10.0, outer_gap_us=100.0)


def test_overlap_counts_once_and_order_does_not_matter(step_profile):
    # a copy on another stream overlapping a kernel; one nested inside; given out of order
    spans = [(20.0, 25.0), (0.0, 10.0), (5.0, 15.0), (6.0, 7.0)]
    g = step_profile.device_gaps(spans)
    assert g == dict(kernels=4, busy_us=20.0, inner_gap_us=5.0, outer_gap_us=0.0)
    assert step_profile.device_gaps([]) == dict(kernels=0, busy_us=0.0, inner_gap_us=0.0, outer_gap_us=0.0)


def test_step_gap_threshold(step_profile):
    spans = [(0.0, 1.0), (31.0, 32.0)]
    assert step_profile.device_gaps(spans)["outer_gap_us"] == 30.0
    assert step_profile.device_gaps(spans, step_gap_us=31.0)["inner_gap_us"] == 30.0


def test_profile_kv_runs_on_the_cpu_with_gemm_knobs(step_profile, monkeypatch):
    """The bench's path up to the profiler, on the CPU (a tiny model, float32): the engine is built with
    ``--max-num-seqs`` above the batch, the GEMM knobs route its projections, every prompt is prefilled, the steps
    run under the profiler (no device events on a CPU: empty tables) and the floors' bytes come out."""
    import argparse

    from tests.tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("llama")
    real = step_profile.Engine.from_pretrained
    built = []

    def cpu_engine(model, **kw):
        built.append(kw)
        engine = real(model, **{**kw, "dtype": "float32", "device": "cpu"})
        built.append(engine)
        return engine

    monkeypatch.setattr(step_profile.Engine, "from_pretrained", cpu_engine)
    args = argparse.Namespace(ctx=64, steps=3, batch=3, max_num_seqs=8, mixed=0, decode_knobs={"GEMM_SWAP_ROWS": 4})
    prompts = [[5] * 20, [6] * 30, [7] * 64]
    step, wall_ms, mixed, floors, per_step = step_profile.profile_kv(hf, prompts, "auto", args)
    kw, engine = built
    assert kw["max_num_seqs"] == 8 and kw["kv_cache_dtype"] == "auto"
    routed = [m.gemm_by_rows for m in engine.model.modules() if hasattr(m, "gemm_by_rows")]
    assert routed and all(r == dict.fromkeys(range(1, 5), "swap") for r in routed)
    assert step == {} and mixed is None and wall_ms > 0
    assert per_step == dict(kernels_per_step=0.0, busy_ms=0.0, inner_gap_ms=0.0, outer_gap_ms=0.0)
    assert floors["attn_floor_ms"] > 0 and floors["gemm_floor_ms"] == engine.model.weight_bytes_per_step()
