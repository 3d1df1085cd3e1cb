"""The benchmarks' bookkeeping around a run (CPU only): bench/partial_rollout.py's steady-state handed-out rate
(issue 23.6: a partial run's first rounds fill its pipeline) and scripts/bench.py's retry when the KV cache a
workload needs does not fit (an H100 running W2: the retry must not hold the failed engine's weights), and
bench/score_bench.py's attention share of the kernel time (issue 23.7)."""

import argparse
import sys

import pytest

from rollout.engine.runners.kv_cache import KVCacheTooLarge
from tests.script_helpers import load_bench, load_script


def _round(secs: float, tokens: int) -> dict:
    return {"round_time_s": secs, "completion_tokens": tokens}


def test_steady_state_counts_only_the_rounds_after_the_warmup():
    partial = load_bench("partial_rollout")
    rounds = [_round(40.0, 600_000), _round(140.0, 2_000_000), _round(100.0, 2_100_000), _round(100.0, 1_900_000)]
    got = partial.steady_state(rounds, 2)
    assert got == {"warmup_rounds": 2, "steady_handed_out_tokens": 4_000_000, "steady_wall_s": 200.0,
                   "steady_handed_out_tok_s": 20_000.0}
    assert partial.steady_state(rounds, 0) == {}  # no warm-up asked: the record has only the whole-run rate
    assert partial.steady_state(rounds, 4) == {}  # nothing left after the warm-up


def test_steady_rounds_are_charged_the_push_before_them():
    partial = load_bench("partial_rollout")
    rounds = [dict(_round(40.0, 600_000), push_after_s=5.0), dict(_round(140.0, 2_000_000), push_after_s=3.0),
              _round(97.0, 2_000_000)]
    got = partial.steady_state(rounds, 2)  # round 3 and the push after round 2
    assert got["steady_wall_s"] == 100.0 and got["steady_handed_out_tok_s"] == 20_000.0
    assert partial.steady_state(rounds, 1)["steady_wall_s"] == 5.0 + 140.0 + 3.0 + 97.0


def test_per_round_counters_are_deltas_and_the_floor_uses_the_bandwidth():
    partial = load_bench("partial_rollout")
    c = [dict(generated=100, prefill=10, bytes=0, compute_s=1.0),
         dict(generated=1_100, prefill=510, bytes=6 * 10**12, compute_s=3.5),
         dict(generated=2_100, prefill=2_510, bytes=9 * 10**12, compute_s=5.0)]
    got = partial.per_round_counters(c, 3.0)
    assert got == {"generated_tokens_per_round": [1_000, 1_000], "prefill_tokens_per_round": [500, 2_000],
                   "gpu_compute_s_per_round": [2.5, 1.5], "floor_s_per_round": [2.0, 1.0]}
    assert "floor_s_per_round" not in partial.per_round_counters(c, None)  # the CPU measures no bandwidth


def test_a_time_budget_stops_between_rounds():
    partial = load_bench("partial_rollout")
    assert not partial.out_of_time(100.0, None, [50.0])  # no budget
    assert not partial.out_of_time(100.0, 200.0, [])  # nothing to go by before the first round
    assert not partial.out_of_time(100.0, 200.0, [40.0, 90.0])  # the longest round still fits
    assert partial.out_of_time(100.0, 200.0, [40.0, 110.0])


def test_partial_rollout_parses_warmup_rounds(monkeypatch):
    partial = load_bench("partial_rollout")
    seen = {}

    def fake_run(mode, hf, args):
        seen[mode] = args.warmup_rounds
        return {"mode": mode}

    monkeypatch.setattr(partial, "build_model", lambda preset: None)
    monkeypatch.setattr(partial, "run", fake_run)
    bench, applied = load_script("bench"), []
    monkeypatch.setattr(partial, "load_bench", lambda: argparse.Namespace(
        emit=lambda rec, out: None, parse_decode_knobs=bench.parse_decode_knobs, apply_decode_knobs=applied.append))
    monkeypatch.setattr(sys, "argv", ["partial_rollout.py", "--modes", "drain,partial", "--warmup-rounds", "2"])
    partial.main()
    assert seen == {"drain": 2, "partial": 2}
    # both modes on an fp8 cache with the decode kernel's knobs (the stream split), parsed as scripts/bench.py does
    monkeypatch.setattr(partial, "run", lambda mode, hf, args: seen.update({mode: (args.kv_cache_dtype,
                                                                                   args.decode_knobs)}) or {})
    monkeypatch.setattr(sys, "argv", ["partial_rollout.py", "--kv-cache-dtype", "fp8", "--decode-knobs",
                                      "STREAM_K_FP8=1"])
    partial.main()
    assert seen["partial"] == seen["drain"] == ("fp8", {"STREAM_K_FP8": 1}) and applied[-1] == {"STREAM_K_FP8": 1}
    for bad in (["--decode-knobs", "NOPE=1"], ["--kv-cache-dtype", "int4"]):
        monkeypatch.setattr(sys, "argv", ["partial_rollout.py", *bad])
        with pytest.raises(SystemExit):
            partial.main()
    monkeypatch.setattr(sys, "argv", ["partial_rollout.py", "--time-budget-s", "-1"])
    with pytest.raises(SystemExit):
        partial.main()


def test_bench_retries_a_kv_cache_that_does_not_fit_outside_the_failed_attempt(monkeypatch):
    """The retry runs after the exception is gone: inside the ``except`` its traceback keeps the failed engine
    (a second copy of the weights on the GPU), and the count that fits was measured without that copy."""
    bench = load_script("bench")
    calls = []

    def from_pretrained(hf, num_blocks, **opts):
        calls.append((num_blocks, sys.exc_info()[1]))
        if len(calls) == 1:
            raise KVCacheTooLarge(f"num_blocks={num_blocks} does not fit", 1000)
        return "engine"

    monkeypatch.setattr(bench.Engine, "from_pretrained", staticmethod(from_pretrained))
    from rollout import SamplingParams

    w = {"prompt_len": 512, "new": 16384, "n": 1, "preset": "qwen2.5-1.5b"}
    args = argparse.Namespace(max_num_seqs=256, kv_cache_dtype="auto", block_size=16, attention_backend="auto",
                              kv_budget_frac=None, preemption=None, decode_split="balanced")
    engine, info = bench.make_engine(None, w, [SamplingParams(max_tokens=16384)] * 64, "async", args)
    assert engine == "engine" and info["kv_budget_fit"] is False
    assert calls[1][0] == 1000
    assert calls[1][1] is None, "the retry ran while the KVCacheTooLarge (and the failed engine) was still alive"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_score_bench_reports_the_attention_share_of_kernel_time():
    """Issue 23.7 asks for the attention share of a scoring run's kernel time, Triton's and FA4's."""
    score = load_bench("score_bench")
    kernels = [("nvjet_tst_128x256_64x4_gemm", 600.0), ("_prefill_kernel", 300.0), ("_rms_norm_kernel", 100.0)]
    assert score.attention_share(kernels) == {"attention_ms": 0.3, "attention_share": 0.3}
    fa4 = [("cutlass___call___flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object", 250.0),
           ("nvjet_gemm", 750.0)]
    assert score.attention_share(fa4)["attention_share"] == 0.25
    assert score.attention_share([]) == {"attention_ms": 0.0, "attention_share": 0.0}


def test_partial_record_names_the_commit_from_the_environment_first(monkeypatch):
    """The GPU machine's copy of the tree may carry a stale .git: $COMMIT (device_env.sh sets it) wins, as in
    scripts/bench.py (a keep-KV run at 3de8f38 was recorded as 32d8e57 by git)."""
    partial = load_bench("partial_rollout")
    monkeypatch.setenv("COMMIT", "abc1234")
    assert partial._commit() == "abc1234"
