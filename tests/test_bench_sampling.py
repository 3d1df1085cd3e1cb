"""scripts/bench.py's ``--sampling``: which SamplingParams each workload's requests get (CPU only)."""

import argparse

import pytest

from tests.script_helpers import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench")


def _params(bench, workload, sampling):
    w = dict(bench.WORKLOADS[workload], prompts=3, new=300)
    name = bench.sampling_of(w, argparse.Namespace(sampling=sampling))
    return name, bench.make_prompts(w, 1000, name)[1]


def test_defaults_keep_w2_sampling_and_the_rest_greedy(bench):
    name, params = _params(bench, "W3", None)
    assert name == "greedy" and all(p.temperature == 0 and p.seed is None for p in params)
    name, params = _params(bench, "W2", None)
    assert name == "t1" and [p.seed for p in params] == [0, 1, 2]
    assert all(p.temperature == 1.0 and p.top_p == 1.0 and p.n == 8 for p in params)


@pytest.mark.parametrize("workload", ["W1", "W2", "W3"])
def test_sampling_setting_applies_to_every_workload(bench, workload):
    name, params = _params(bench, workload, "t1p95")
    assert name == "t1p95"
    assert all(p.temperature == 1.0 and p.top_p == 0.95 and p.seed == i for i, p in enumerate(params))
    _, params = _params(bench, workload, "greedy")
    assert all(p.temperature == 0.0 for p in params)
