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
