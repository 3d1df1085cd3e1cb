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


def test_roofline_takes_the_larger_of_bytes_and_flops_per_op_class(bench):
    """A step's GEMMs are bound by their weight bytes at small batch and by FLOPs at large batch; the
    attention by its KV bytes (4 * Hq * D FLOPs per cached token is far below the roof)."""
    from types import SimpleNamespace

    rec = SimpleNamespace
    # 1 TB/s, 100 TFLOP/s; 1 GB of weights = 0.5 G weights (bf16): 1 ms of bytes, 2 * 0.5e9 * B FLOPs
    args = dict(weight_bytes=10**9, kv_token_bytes=1000, gemm_weights=5 * 10**8, attn_flops_per_token=10**4,
                bw_tbps=1.0, peak_tflops=100.0)
    small = bench.roofline_s([rec(batch=8, kv_tokens=10**6)], **args)
    assert small["gemm"] == pytest.approx(1e-3) and small["attn"] == pytest.approx(1e-3)  # bytes-bound
    big = bench.roofline_s([rec(batch=1000, kv_tokens=10**6)], **args)
    assert big["gemm"] == pytest.approx(2 * 5e8 * 1000 / 1e14)  # 10 ms of FLOPs beats 1 ms of bytes
    assert big["gemm_compute_bound_steps"] == 1 and small["gemm_compute_bound_steps"] == 0
    both = bench.roofline_s([rec(batch=8, kv_tokens=10**6), rec(batch=1000, kv_tokens=10**6)], **args)
    assert both["total"] == pytest.approx(small["total"] + big["total"])


def test_decode_by_batch_groups_steps_with_their_floor(bench):
    """W2's records say per batch-size bucket how many decode steps ran, their mean compute and byte floor."""
    from types import SimpleNamespace

    rec = SimpleNamespace
    steps = [rec(batch=8, kv_tokens=10**6, compute_ms=4.0), rec(batch=31, kv_tokens=3 * 10**6, compute_ms=8.0),
             rec(batch=256, kv_tokens=0, compute_ms=2.0)]
    # 1 TB/s: 1 GB of weights is 1 ms; 1,000 bytes a token, 10^6 tokens another 1 ms
    table = bench.decode_by_batch(steps, 10**9, 1000, 1.0)
    assert table == {"0": [2, 6.0, 3.0, 0.5], "256": [1, 2.0, 1.0, 0.5]}
    assert bench.decode_by_batch([], 10**9, 1000, 1.0) == {}


def test_decode_by_kind_splits_the_buckets_by_the_kernels_split_rule(bench):
    """Each decode step records the split kind it ran (the CUDA runner's StepRecord.split), and W2's record breaks
    its buckets down by it: a bucket whose fp8/bf16 ratio breaks from its neighbours' names the rule to look at."""
    from types import SimpleNamespace

    from rollout.engine.runners.cuda import CudaPendingStep, StepClock

    class Ev:
        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 3.0

    out = SimpleNamespace(tolist=lambda: [7])
    slot = SimpleNamespace(d2h_done=Ev(), compute_start=Ev(), compute_end=Ev(), host_tokens=out, host_logprobs=out)
    clock = StepClock(record_steps=True)
    plan = SimpleNamespace(step_id=0, num_context_tokens=10**6)
    CudaPendingStep(plan, slot, [0], True, 8, clock, graph_b=8, split=2).result()
    assert clock.records[0].split == 2 and clock.records[0].compute_ms == 3.0
    rec = SimpleNamespace
    steps = [clock.records[0], rec(batch=31, kv_tokens=3 * 10**6, compute_ms=8.0, split=1),
             rec(batch=256, kv_tokens=0, compute_ms=2.0)]  # no split field: an older record reads as uneven
    table = bench.decode_by_kind(steps, 10**9, 1000, 1.0)
    assert table == {"even": {"0": [1, 8.0, 4.0, 0.5]}, "uneven": {"256": [1, 2.0, 1.0, 0.5]},
                     "uniform": {"0": [1, 3.0, 2.0, 0.667]}}


def test_compare_legacy_builds_backends_with_the_fixed_split(bench):
    """--compare-legacy (issue 23.4): a backend built inside ``legacy_decode_split`` passes the previous
    heuristic's num_splits (per batch size, from max_model_len) to the decode kernel; one built outside, none."""
    import torch

    import rollout.kernels.paged_decode as pd
    from rollout.layers.triton_backend import TritonAttentionBackend

    real = pd.paged_decode_attention
    calls = []
    cache = torch.zeros(2, 4, 16, 2, 128, dtype=torch.bfloat16)
    q = torch.zeros(3, 12, 128, dtype=torch.bfloat16)
    with bench.legacy_decode_split(4096) as legacy:
        assert pd.paged_decode_attention == legacy.decode
        legacy.kernel = lambda *a, **kw: calls.append((a, kw))
        backend = TritonAttentionBackend()
    assert pd.paged_decode_attention is real, "the kernel must be restored after the block"
    backend._decode(q, cache, torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, dtype=torch.int32), 0.1,
                    kv_scales=None)
    expect = pd.choose_num_splits(3, 2, -(-4096 // pd.decode_config(16, 128, torch.bfloat16)[0]), pd.num_sms(q.device))
    (args, kw), = calls
    assert args[7] == expect and kw == {"kv_scales": None}
    assert TritonAttentionBackend()._decode is real
    parser_args = bench.parse_args(["--workload", "W3", "--compare-legacy"])
    assert parser_args.compare_legacy


def test_warm_up_samples_the_runs_groups_on_shifted_prompts(bench):
    """The warm-up runs the run's prompts (shifted: no prefix-cache hit later) in groups of n, so the siblings'
    prefix hits and mixed steps compile before the timing; then every decode graph size, even and uneven."""
    calls = []

    class Fake:
        runner = argparse.Namespace(graph_sizes=[1, 2, 4, 8])

        def generate(self, prompts, params):
            calls.append((prompts, params))

    w = dict(bench.WORKLOADS["W2"], prompts=3, new=300)
    prompts, params = bench.make_prompts(w, 1000, "t1")
    bench.warm_up(Fake(), prompts, 8, 256, bench.sampling_kw("t1", 0))
    shifted = [c for c in calls if len(c[0]) == 3 and len(c[0][0]) == w["prompt_len"]]
    assert len(shifted) == 1 and shifted[0][1].n == 8 == params[0].n
    assert all(a[0] == b[0] + 1 for a, b in zip(shifted[0][0], prompts)), "shifted: no prefix shared with the run"
    sizes = sorted({len(c[0]) for c in calls if c[1].max_tokens == 3})
    assert sizes == [1, 2, 4, 8], "every graph size the run can reach (3 x 8 sequences) is captured"
