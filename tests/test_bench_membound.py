"""scripts/bench.py's memory-bound options (issue 23.5): ``--kv-budget-frac`` sizes the KV cache to a fraction of
the workload's need in bf16 bytes (fp8 the same bytes, ~2x the blocks), ``--preemption`` picks swap / recompute,
refusals name the value and what is allowed, and the per-config ratios land in the records (CPU only)."""

import argparse

import pytest

from tests.script_helpers import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench")


def test_block_bytes_match_the_engine_layout(bench):
    # qwen2.5-1.5b: 28 layers, 2 kv heads, head_dim 1536 / 12 = 128; K and V; bf16 2 bytes, fp8 1 byte + fp16 scale
    assert bench.kv_block_bytes("qwen2.5-1.5b", "auto", 16) == 2 * 28 * 16 * 2 * 128 * 2
    assert bench.kv_block_bytes("qwen2.5-1.5b", "bfloat16", 16) == bench.kv_block_bytes("qwen2.5-1.5b", "auto", 16)
    assert bench.kv_block_bytes("qwen2.5-1.5b", "fp8", 16) == 2 * 28 * 16 * 2 * (128 + 2)
    assert bench.kv_block_bytes("qwen3-0.6b", "float32", 16) == 2 * 28 * 16 * 8 * 128 * 4  # explicit head_dim


@pytest.fixture
def tiny(bench):
    """A tiny qwen2 model and a bench preset of its shape."""
    from tests.tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("qwen2", seed=0)
    cfg = hf.config
    bench.PRESETS["tiny-test"] = ("qwen2", dict(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                                                num_attention_heads=cfg.num_attention_heads,
                                                num_key_value_heads=cfg.num_key_value_heads))
    yield hf
    del bench.PRESETS["tiny-test"]


def test_engine_kv_cache_agrees_on_block_bytes(bench, tiny):
    """The budget's arithmetic is the engine's: a tiny engine's KVCache.block_bytes for bf16 and fp8."""
    from rollout import Engine

    for kv in ("auto", "fp8"):
        engine = Engine.from_pretrained(tiny, dtype="bfloat16", device="cpu", kv_cache_dtype=kv, num_blocks=8,
                                        max_model_len=64)
        assert engine.kv.block_bytes == bench.kv_block_bytes("tiny-test", kv, engine.kv.config.block_size)


def test_make_engine_holds_the_budget_and_swaps_only_with_a_pool(bench, tiny):
    """make_engine under --kv-budget-frac 0.3 (a tiny W2: n=2, long tail): the blocks of the budget, fp8 ~2x
    bf16's; the run preempts, and swaps to the host pool only in swap mode."""
    w = dict(preset="tiny-test", prompts=4, prompt_len=32, new=64, min_new=48, n=2)
    prompts, params = bench.make_prompts(w, tiny.config.vocab_size, "t1")
    need = bench.kv_need_blocks(32, params, 16)
    got = {}
    for kv, pre in (("auto", "swap"), ("fp8", "recompute")):
        args = argparse.Namespace(max_num_seqs=8, kv_cache_dtype=kv, kv_budget_frac=0.3, preemption=pre)
        engine, info = bench.make_engine(tiny, w, params, "sync", args)
        assert engine.kv.num_blocks == bench.kv_budget(need, 0.3, "tiny-test", kv, 16)[0]
        assert info["kv_need_blocks"] == need and info["preemption"] == pre and info["kv_budget_fit"]
        assert (info["swap_space_gib"] > 0) == (pre == "swap") == (engine.kv.num_host_blocks > 0)
        outs = engine.generate(prompts, params)
        assert sum(len(c.token_ids) for o in outs for c in o.outputs) == sum(p.n * p.max_tokens for p in params)
        got[kv] = engine.get_stats(), engine.kv.num_blocks
    (bf16, bf16_blocks), (fp8, fp8_blocks) = got["auto"], got["fp8"]
    assert fp8_blocks > 1.7 * bf16_blocks
    assert bf16.num_preemptions > 0 and bf16.num_swap_outs > 0 and bf16.swapped_out_bytes > 0
    assert fp8.num_swap_outs == 0


def test_need_counts_every_sequence_at_its_full_length(bench):
    from rollout import SamplingParams

    params = [SamplingParams(n=8, max_tokens=100), SamplingParams(n=8, max_tokens=1000), SamplingParams(max_tokens=16)]
    # (512 + 100) / 16 -> 39 blocks (rounded up), (512 + 1000) / 16 -> 95 blocks, (512 + 16) / 16 = 33
    assert bench.kv_need_blocks(512, params, 16) == 8 * 39 + 8 * 95 + 33


@pytest.mark.parametrize("frac", [0.3, 1.0, 0.01])
def test_budget_gives_fp8_the_same_bytes_so_about_twice_the_blocks(bench, frac):
    need = 100_000
    bf16_blocks, bf16_bytes = bench.kv_budget(need, frac, "qwen2.5-1.5b", "auto", 16)
    fp8_blocks, fp8_bytes = bench.kv_budget(need, frac, "qwen2.5-1.5b", "fp8", 16)
    assert bf16_blocks == int(frac * need)  # bf16: frac of the blocks (the need is counted in bf16)
    budget = frac * need * bench.kv_block_bytes("qwen2.5-1.5b", "auto", 16)
    block8 = bench.kv_block_bytes("qwen2.5-1.5b", "fp8", 16)
    assert fp8_bytes <= budget < fp8_bytes + block8 and bf16_bytes <= budget
    assert fp8_blocks / bf16_blocks == pytest.approx(128 * 2 / 130, rel=1e-3)  # 1.97x
    assert bench.kv_budget(need, frac, "qwen2.5-1.5b", "bfloat16", 16)[0] == bf16_blocks


def test_w2_mem_at_30_percent_is_short_of_its_need(bench):
    w = bench.WORKLOADS["W2-mem"]
    assert w["preset"] == "qwen2.5-1.5b" and w["prompt_len"] == 512 and w["n"] == 8
    assert w["prompts"] * w["n"] <= 256  # every sequence admitted at once: the need is what the batch holds
    _, params = bench.make_prompts(w, 151936, "t1")
    assert all(w.get("min_new", 256) <= p.max_tokens <= w["new"] and p.temperature == 1.0 for p in params)
    assert [p.seed for p in params] == list(range(w["prompts"]))
    generated = sum(p.n * p.max_tokens for p in params)
    assert 1_000_000 <= generated <= 2_000_000
    need = bench.kv_need_blocks(w["prompt_len"], params, 16)
    blocks, nbytes = bench.kv_budget(need, 0.3, w["preset"], "auto", 16)
    assert blocks < 0.31 * need and nbytes < 20 * 2**30
    # the swap pool holds what the budget leaves out
    pool = bench.swap_space_gib(need, blocks, bench.kv_block_bytes(w["preset"], "auto", 16))
    assert (need - blocks) * bench.kv_block_bytes(w["preset"], "auto", 16) <= pool * 2**30 < 48 * 2**30


def test_w2_lengths_are_unchanged_by_min_new(bench):
    """W2 keeps its 256-token floor (the same draws as before ``min_new`` existed)."""
    w = dict(bench.WORKLOADS["W2"], prompts=4)
    lens = [p.max_tokens for p in bench.make_prompts(w, 1000, "t1")[1]]
    assert lens == [p.max_tokens for p in bench.make_prompts(dict(w, min_new=256), 1000, "t1")[1]]
    assert all(256 <= k <= w["new"] for k in lens)


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.3", "nan", "0.3,2"])
def test_budget_outside_zero_one_is_refused(bench, bad, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "W2-mem", "--kv-budget-frac", bad])
    assert "--kv-budget-frac must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        bench.kv_budget(1000, float(bad.split(",")[-1]), "qwen2.5-1.5b", "auto", 16)


def test_budget_that_is_not_a_number_is_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--kv-budget-frac", "thirty"])
    assert "comma list of numbers in (0, 1], got 'thirty'" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["swapp", "swap,swap", "recompute,", "none"])
def test_preemption_modes_are_checked(bench, bad, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--kv-budget-frac", "0.3", "--preemption", bad])
    assert "--preemption takes a comma list of swap, recompute" in capsys.readouterr().err


def test_preemption_needs_a_budget_and_multiturn_takes_none(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "W2-mem", "--preemption", "swap"])
    assert "give --kv-budget-frac too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "W4", "--kv-budget-frac", "0.3"])
    assert "not ['W4', 'W4-geo']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "W9"])
    assert "unknown --workload ['W9']" in capsys.readouterr().err


def test_the_gpu_command_parses_into_every_config(bench):
    args = bench.parse_args(["--workload", "W2-mem", "--kv-cache-dtype", "auto,fp8", "--kv-budget-frac", "0.3",
                             "--preemption", "swap,recompute", "--sampling", "t1", "--modes", "async"])
    assert (args.kv_cache_dtype, args.kv_budget_frac, args.preemption) == ("auto", 0.3, "swap")
    assert bench.configs_of(args) == [("auto", 0.3, "swap"), ("fp8", 0.3, "swap"),
                                      ("auto", 0.3, "recompute"), ("fp8", 0.3, "recompute")]
    one = bench.with_config(args, "fp8", 0.3, "recompute")
    assert (one.kv_cache_dtype, one.kv_budget_frac, one.preemption) == ("fp8", 0.3, "recompute")
    plain = bench.parse_args(["--kv-cache-dtype", "auto,fp8"])  # without the new options: as before
    assert plain.kv_budget_fracs is None and bench.configs_of(plain) == [("auto", None, None), ("fp8", None, None)]


def test_config_ratios_pair_records_by_budget_preemption_and_dtype(bench):
    def rec(kv, pre, tok_s, frac=0.3):
        return dict(workload="W2-mem", mode="async", kv_cache_dtype=kv, kv_budget_frac=frac, preemption=pre,
                    tok_s=tok_s, preemptions=10, swap_outs=1, swap_ins=1, wall_s=1.0)

    recs = [rec("auto", "swap", 100.0), rec("fp8", "swap", 150.0), rec("auto", "recompute", 80.0),
            rec("fp8", "recompute", 140.0), rec("auto", "swap", 300.0, frac=0.6), dict(workload="weight_push")]
    lines = bench.config_ratios(recs, "auto")
    assert recs[1]["fp8_vs_bf16"] == 1.5 and recs[1]["vs_first_kv"] == 1.5
    assert recs[3]["fp8_vs_bf16"] == 1.75
    assert recs[0]["swap_vs_recompute"] == 1.25 and recs[1]["swap_vs_recompute"] == round(150 / 140, 3)
    assert "fp8_vs_bf16" not in recs[0] and "swap_vs_recompute" not in recs[2] and "swap_vs_recompute" not in recs[4]
    assert len(lines) == 5 and "fp8_vs_bf16 1.5" in lines[1] and "swap_vs_recompute 1.25" in lines[0]


def test_membound_sim_replays_a_tiny_workload(bench):
    """bench/membound_sim.py drives the real scheduler: a tight budget preempts, swap then swaps (n=1)."""
    from tests.script_helpers import load_bench

    sim = load_bench("membound_sim")
    from rollout import SamplingParams

    w = dict(prompt_len=32, new=64)
    params = [SamplingParams(max_tokens=64, ignore_eos=True) for _ in range(8)]
    need = bench.kv_need_blocks(32, params, 16)
    roomy = sim.simulate(w, params, need, 0, 1000, "auto")
    assert roomy["preemptions"] == 0 and roomy["generated_tokens"] == 8 * 64 and roomy["finished"]
    tight = sim.simulate(w, params, need // 3, 0, 1000, "auto")
    assert tight["preemptions"] > 0 and tight["finished"] and tight["prefill_tokens"] > roomy["prefill_tokens"]
    swapped = sim.simulate(w, params, need // 3, need, 1000, "auto")
    assert swapped["swap_outs"] > 0 and swapped["prefill_tokens"] < tight["prefill_tokens"]


def test_decode_knobs_parse_apply_and_refuse(bench, capsys, monkeypatch):
    import rollout.kernels.paged_decode as pd

    args = bench.parse_args(["--workload", "W2", "--decode-knobs", "V_PAGES=1,DECODE_WAVES=2"])
    assert args.decode_knobs == {"V_PAGES": 1, "DECODE_WAVES": 2}
    for name in args.decode_knobs:
        monkeypatch.setattr(pd, name, getattr(pd, name))  # restored after the test
    bench.apply_decode_knobs(args.decode_knobs)
    assert pd.V_PAGES is True and pd.DECODE_WAVES == 2
    assert pd.choose_split_target(2, 132) == 2 * pd.PROGRAMS_PER_SM * 132 // 2  # read at call time
    from rollout.layers.triton_backend import TritonAttentionBackend

    monkeypatch.setattr(TritonAttentionBackend, "fuses_rope", TritonAttentionBackend.fuses_rope)
    bench.apply_decode_knobs(bench.parse_args(["--decode-knobs", "FUSED_ROPE=0"]).decode_knobs)
    assert TritonAttentionBackend.fuses_rope is False  # the A/B switch of the rotary + K/V store fusion
    import rollout.kernels.paged_decode_stream as ps

    monkeypatch.setattr(pd, "STREAM_K", pd.STREAM_K)
    monkeypatch.setattr(ps, "STREAM_WAVES", ps.STREAM_WAVES)
    monkeypatch.setattr(ps, "STREAM_SEGS", ps.STREAM_SEGS)
    knobs = bench.parse_args(["--decode-knobs", "STREAM_K=1,STREAM_WAVES=2,STREAM_SEGS=4"]).decode_knobs
    bench.apply_decode_knobs(knobs)
    # the stream split's switch, its waves and its unrolled segments (the last two in its own module)
    assert pd.STREAM_K is True and ps.STREAM_WAVES == 2 and ps.STREAM_SEGS == 4
    assert ps.stream_programs(2, 132, 6) == 2 * 6 * 132 // 2
    for bad, msg in (("V_PAGE=1", "expected NAME=INT"), ("V_PAGES", "expected NAME=INT"), ("V_PAGES=yes", "integer")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--decode-knobs", bad])
        assert msg in capsys.readouterr().err
